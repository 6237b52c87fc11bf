"""Multi-run studies that `openmoe-ablate --study=NAME` runs (cli/ablate.py)."""
