"""Routing analysis (OpenMoE's findings): record routing, analyse it, plot, report.

`openmoe-analyze` (cli/analyze.py, through study.py) does all of it for a
MODEL_DIR; the pieces:
routing.flatten_routing -> record.RoutingRecord (npz) -> analyses.* (plain dicts)
-> plots.* (PNG) -> report.write_report (report.md + report.json).
"""
