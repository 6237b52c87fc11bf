"""Tests for openmoe_jax.gin_utils: flags, search paths, errors, operative config."""
import logging
import os
import subprocess
import sys
import textwrap

import gin
import pytest

from openmoe_jax import gin_utils

from run_files import write_file


@gin.configurable
def toy_train(model_dir=gin.REQUIRED, steps=10, optimizer=None):
  return model_dir, steps, optimizer


@gin.configurable
def toy_optimizer(learning_rate=0.1):
  return ("toy_optimizer", learning_rate)


def _write(path, text):
  write_file(path, textwrap.dedent(text))


@pytest.fixture
def library_gin_dir(tmp_path, monkeypatch):
  """A stand-in for the installed gin folder, with an include chain."""
  root = tmp_path / "library_gin"
  _write(root / "models" / "tiny.gin", """
      toy_optimizer.learning_rate = 0.5
      """)
  _write(root / "runs" / "quickstart.gin", """
      include 'models/tiny.gin'
      MODEL_DIR = '/default/dir'
      toy_train.model_dir = %MODEL_DIR
      toy_train.steps = 100
      toy_train.optimizer = @toy_optimizer()
      """)
  monkeypatch.setattr(gin_utils, "gin_config_dir", lambda: str(root))
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  return root


def test_parse_flags_splits_gin_and_other_args():
  files, bindings, paths, other = gin_utils.parse_flags([
      "prog", "--gin_file=runs/quickstart.gin", "--gin_file", "extra.gin",
      "--gin.toy_train.steps=7", "--gin.MODEL_DIR=\"/tmp/x\"", "--gin.MODEL_DIR=/tmp/y",
      "--gin.MIXTURE_OR_TASK_NAME=c4_tiny", "--gin.toy_train.optimizer=@toy_optimizer()",
      "--gin_search_paths=a,b", "--gin_bindings=toy_optimizer.learning_rate=1e-3",
      "--verbose"])
  assert files == ["runs/quickstart.gin", "extra.gin"]
  assert bindings == [
      "toy_train.steps = 7", 'MODEL_DIR = "/tmp/x"', "MODEL_DIR = '/tmp/y'",
      "MIXTURE_OR_TASK_NAME = 'c4_tiny'", "toy_train.optimizer = @toy_optimizer()",
      "toy_optimizer.learning_rate=1e-3"]
  assert paths == ["a", "b"]
  assert other == ["prog", "--verbose"]
  with pytest.raises(gin_utils.GinConfigError):
    gin_utils.parse_flags(["--gin.steps"])


@pytest.mark.parametrize("value,expected", [
    ("100", "100"), ("1e-3", "1e-3"), ("True", "True"), ("None", "None"),
    ("[1, 2]", "[1, 2]"), ("'x'", "'x'"), ("%MODEL_DIR", "%MODEL_DIR"),
    ("@scope/fn()", "@scope/fn()"), ("gs://bucket/run", "'gs://bucket/run'"),
    ("c4_tiny", "'c4_tiny'"), ("my-mixture", "'my-mixture'"), ("[1, 2", "[1, 2"),
])
def test_quote_if_bare(value, expected):
  assert gin_utils.quote_if_bare(value) == expected


def test_parse_gin_from_any_directory_with_includes(library_gin_dir):
  _, bindings, _, _ = gin_utils.parse_flags(
      ["--gin.MODEL_DIR=/tmp/run", "--gin.toy_train.steps=3"])
  gin_utils.parse_gin(["runs/quickstart.gin"], bindings)
  assert toy_train() == ("/tmp/run", 3, ("toy_optimizer", 0.5))


def test_cwd_and_extra_search_paths_come_first(library_gin_dir, tmp_path):
  _write(tmp_path / "elsewhere" / "models" / "tiny.gin", "toy_optimizer.learning_rate = 2.0\n")
  _write(tmp_path / "mine" / "mine.gin", "toy_train.model_dir = 'mine'\n")
  gin_utils.parse_gin(["runs/quickstart.gin", "mine.gin"],
                      gin_search_paths=[str(tmp_path / "mine")])
  assert toy_train() == ("mine", 100, ("toy_optimizer", 2.0))


def test_missing_gin_file_lists_searched_paths(library_gin_dir):
  with pytest.raises(gin_utils.GinConfigError) as err:
    gin_utils.parse_gin(["runs/nope.gin"])
  assert "runs/nope.gin" in str(err.value)
  assert str(library_gin_dir) in str(err.value) and os.getcwd() in str(err.value)


def test_an_include_found_in_a_later_path_logs_no_error_for_the_earlier_ones(
    library_gin_dir, caplog):
  """gin logs "Path not found" for each search path without the included file; the
  parse drops those records, and only those."""
  with caplog.at_level(logging.INFO):
    gin_utils.parse_gin(["runs/quickstart.gin"])  # its include is in the last path
    with gin_utils._gin_search_paths([os.getcwd()]):  # pylint: disable=protected-access
      logging.error("another error")
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
      "another error"]


def test_a_missing_search_path_is_named(tmp_path):
  with pytest.raises(gin_utils.GinConfigError, match=r"^--gin_search_paths: no such "
                     r"folder: '/no/such', '.*absent'$"):
    gin_utils.parse_gin([], gin_search_paths=[str(tmp_path), "/no/such",
                                              str(tmp_path / "absent")])


def test_parse_gin_locks_the_config_unless_told_not_to():
  gin_utils.parse_gin([], ["toy_train.steps = 3"], finalize=False)
  assert not gin.config_is_locked()
  gin.clear_config()
  gin_utils.parse_gin([], ["toy_train.steps = 3"])
  assert gin.config_is_locked()


def test_missing_required_looks_up_a_scope():
  gin_utils.parse_gin([], ["eval/toy_train.model_dir = 'x'"], finalize=False)
  assert gin_utils.missing_required(toy_train, scope="eval") == []
  assert gin_utils.missing_required(toy_train, scope="train") == [
      "train/toy_train.model_dir"]
  assert gin_utils.missing_required(toy_train) == ["toy_train.model_dir"]


def test_missing_include_names_the_file(library_gin_dir):
  _write(library_gin_dir / "runs" / "broken.gin", "include 'models/absent.gin'\n")
  with pytest.raises(gin_utils.GinConfigError, match="models/absent.gin"):
    gin_utils.parse_gin(["runs/broken.gin"])


@pytest.mark.parametrize("binding,message", [
    ("toy_trian.steps = 3", "toy_trian"),
    ("toy_train.stpes = 3", "stpes"),
    ("toy_train.steps = [1", "toy_train.steps"),
])
def test_bad_binding_fails_at_parse_time_naming_it(binding, message):
  with pytest.raises(gin_utils.GinConfigError, match=message) as err:
    gin_utils.parse_gin([], [binding])
  assert binding in str(err.value)


def test_command_line_macro_no_binding_uses_is_an_error_naming_the_closest(
    tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _write(tmp_path / "run.gin", "STEPS = 5\ntoy_train.steps = %STEPS\n")
  gin_utils.parse_gin(["run.gin"], ["STEPS = 7"])  # used: fine
  gin.clear_config()
  with pytest.raises(gin_utils.GinConfigError,
                     match=r"--gin\.STEP: no binding uses the macro STEP.*did you "
                           r"mean STEPS\? macros in use: STEPS$"):
    gin_utils.parse_gin(["run.gin"], ["STEP = 7"])
  gin.clear_config()
  # A macro the program reads itself (gin.query_parameter) counts as used.
  gin_utils.parse_gin(["run.gin"], ["BATCH = 7"], read_macros=("BATCH",))


def test_unknown_binding_in_file_names_file(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  _write(tmp_path / "bad.gin", "toy_train.nonexistent = 1\n")
  with pytest.raises(gin_utils.GinConfigError, match=r"bad\.gin.*nonexistent"):
    gin_utils.parse_gin(["bad.gin"])


def test_check_required_names_unbound_parameters():
  gin_utils.parse_gin([], ["toy_train.steps = 3"], finalize=False)
  assert gin_utils.missing_required(toy_train) == ["toy_train.model_dir"]
  with pytest.raises(gin_utils.GinConfigError, match="toy_train.model_dir"):
    gin_utils.check_required(toy_train, "toy_optimizer")
  gin.parse_config("toy_train.model_dir = %gin.REQUIRED")
  assert gin_utils.missing_required("toy_train") == ["toy_train.model_dir"]
  gin.parse_config("toy_train.model_dir = '/tmp/m'")
  gin_utils.check_required(toy_train)


def test_write_operative_config(tmp_path):
  gin_utils.parse_gin([], ["toy_train.model_dir = 'x'", "toy_train.steps = 5"])
  toy_train()
  path = gin_utils.write_operative_config(str(tmp_path / "runs" / "model"))
  assert path == str(tmp_path / "runs" / "model" / "config.gin")
  text = (tmp_path / "runs" / "model" / "config.gin").read_text()
  assert "toy_train.steps = 5" in text and "toy_train.model_dir = 'x'" in text


def test_import_configurables_propagates_import_errors():
  gin_utils.import_configurables(["openmoe_jax.optim", "openmoe_jax.checkpoints"])
  assert gin.get_configurable("adafactor_openmoe")
  with pytest.raises(ImportError):
    gin_utils.import_configurables(["openmoe_jax.does_not_exist"])


def test_import_configurables_default_list():
  gin_utils.import_configurables()
  for name in ("train", "ModelConfig", "MoeConfig", "CausalLm", "get_vocabulary"):
    assert gin.get_configurable(name)


def test_import_configurables_registers_every_training_configurable_in_a_fresh_process():
  """In a fresh interpreter, `import_configurables()` then a locked config then
  `train`: the data pipeline, which `train` imports lazily, is registered before the
  lock (it used to be imported only inside `train`, after the lock: "Attempted to add
  a new configurable after the config was locked"). Every module with gin
  configurables is imported, except openmoe-plan's own."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = textwrap.dedent("""
      import pathlib, re, sys
      from openmoe_jax import gin_utils
      gin_utils.import_configurables()
      gin_utils.parse_gin(["runs/quickstart.gin"], ["MODEL_DIR = '/tmp/unused'"])
      for path in sorted(pathlib.Path("openmoe_jax").rglob("*.py")):
        if re.search(r"@gin[.]configurable|gin[.]external_configurable", path.read_text()):
          name = ".".join(path.with_suffix("").parts)
          print(name, name in sys.modules)
  """)
  env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  imported = dict(line.split() for line in result.stdout.splitlines())
  assert "openmoe_jax.data.pipeline" in imported and "openmoe_jax.trainer" in imported
  assert [name for name, seen in imported.items() if seen != "True"] == [
      "openmoe_jax.plan"]


def test_gin_config_dir_is_library_folder():
  found = gin_utils.gin_config_dir()
  package_dir = os.path.dirname(os.path.abspath(gin_utils.__file__))
  if found is None:
    assert not os.path.isdir(os.path.join(os.path.dirname(package_dir), "gin"))
  else:
    assert found in (os.path.join(package_dir, "gin_configs"),
                     os.path.join(os.path.dirname(package_dir), "gin"))
    assert not os.path.isfile(os.path.join(found, "config.py"))  # not the gin library


@pytest.mark.parametrize("layout,expected", [
    ({"openmoe_jax/gin_configs/": None, "setup.py": "", "gin/": None},
     "openmoe_jax/gin_configs"),  # an installed wheel's own folder comes first
    ({"setup.py": "", "gin/": None}, "gin"),  # a checkout
    ({"gin/": None}, None),  # site-packages: a sibling gin/ is the gin library
    ({"setup.py": ""}, None),
], ids=["wheel", "checkout", "site_packages", "checkout_without_gin"])
def test_gin_config_dir_in_each_install_layout(tmp_path, monkeypatch, layout, expected):
  for name, text in layout.items():
    if name.endswith("/"):
      (tmp_path / name).mkdir(parents=True)
    else:
      (tmp_path / name).write_text(text)
  (tmp_path / "openmoe_jax").mkdir(exist_ok=True)
  monkeypatch.setattr(gin_utils, "__file__", str(tmp_path / "openmoe_jax" / "gin_utils.py"))
  want = None if expected is None else str(tmp_path / expected)
  assert gin_utils.gin_config_dir() == want


def test_a_gin_flag_without_its_value_is_refused():
  assert gin_utils.parse_flags(["--gin_file", "a.gin"])[0] == ["a.gin"]
  for flag in ("--gin_file", "--gin_search_paths", "--gin_bindings"):
    with pytest.raises(gin_utils.GinConfigError, match=f"^{flag} needs a value$"):
      gin_utils.parse_flags(["prog", flag])


def test_module_docstring_command_line_parses_against_the_library_gin():
  # The flags the module docstring shows must bind what they claim on a real run file.
  line = next(l for l in gin_utils.__doc__.splitlines() if "--gin.MODEL_DIR" in l)
  flags = ["--gin_file=runs/quickstart.gin"] + [
      f for f in line.split() if f.startswith("--gin.")]
  files, bindings, paths, other = gin_utils.parse_flags(flags)
  assert not other and len(bindings) == 2
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(files, bindings, paths, finalize=False)
  assert repr(gin.query_parameter("train.train_steps")) == "%TRAIN_STEPS"
  assert gin.query_parameter("%TRAIN_STEPS") == 100
  assert gin.query_parameter("%MODEL_DIR") == "/tmp/run"


# Model and experiment files configure the model only; each names the modules it
# configures with `import` lines (t5x style), so it parses with nothing registered.
SELF_CONTAINED_GIN_FILES = ("models/openmoe2_moe_8b_a1p7b.gin",
                            "experiments/openmoe2/ec_scaling.gin",
                            "experiments/openmoe2/granularity_256.gin")


@pytest.mark.parametrize("name", SELF_CONTAINED_GIN_FILES)
def test_gin_file_imports_the_modules_it_configures(name):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  code = textwrap.dedent(f"""
      import sys
      import gin
      from openmoe_jax import gin_utils
      assert "openmoe_jax.config" not in sys.modules
      gin_utils.parse_gin([{name!r}], finalize=False)
      from openmoe_jax.config import ModelConfig
      print(type(ModelConfig().moe.router).__name__,
            type(ModelConfig().moe.dispatcher).__name__)
  """)
  env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
  result = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Router" in result.stdout


def test_a_gin_file_in_the_current_folder_wins_over_a_search_path(library_gin_dir,
                                                                   tmp_path):
  """Lookup order: current folder, then --gin_search_paths, then the library."""
  _write(tmp_path / "elsewhere" / "pick.gin", "toy_train.model_dir = 'cwd'\n")
  _write(tmp_path / "mine" / "pick.gin", "toy_train.model_dir = 'search path'\n")
  assert gin_utils.search_paths([str(tmp_path / "mine")]) == [
      str(tmp_path / "elsewhere"), str(tmp_path / "mine"), str(library_gin_dir)]
  gin_utils.parse_gin(["runs/quickstart.gin", "pick.gin"],
                      gin_search_paths=[str(tmp_path / "mine")])
  assert toy_train()[0] == "cwd"
