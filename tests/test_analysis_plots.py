"""The routing study's plots draw the numbers they are given (analysis/plots.py):
each figure is caught as it is closed and its bars, curves and images read back."""
import matplotlib.pyplot as plt
import numpy as np
import pytest

from openmoe_jax.analysis import plots


@pytest.fixture
def figures(monkeypatch):
  """Collects every figure the plots close (and closes it after the test)."""
  caught, close = [], plt.close
  monkeypatch.setattr(plots.plt, "close", caught.append)
  yield caught
  for fig in caught:
    close(fig)


def _curves(ax):
  return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
          for line in ax.get_lines()}


def test_specialization_bars_put_each_score_under_its_label(figures, tmp_path):
  result = {"position_field": "doc_position", "per_layer": [
      {"layer": 1, "token": {"score": 0.75}, "position": {"score": 0.1}},
      {"layer": 3, "token": {"score": 0.5}, "position": {"score": -0.2}}]}
  path = str(tmp_path / "s.png")
  assert plots.plot_specialization_scores(result, path) == path
  (ax,) = figures[0].axes
  bars = {(round(p.get_x() + p.get_width() / 2, 6), round(p.get_height(), 6))
          for p in ax.patches}
  assert bars == {(-0.2, 0.75), (0.2, 0.1), (0.8, 0.5), (1.2, -0.2)}
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["token id",
                                                                 "doc_position"]
  assert [t.get_text() for t in ax.get_xticklabels()] == ["layer 1", "layer 3"]
  assert ax.get_ylim()[0] == pytest.approx(-0.2 - 0.05 * 1.25, abs=0.05)  # shows -0.2


def test_expert_heatmaps_show_each_layers_matrix(figures, tmp_path):
  dist = [[[1.0, 0.0], [0.25, 0.75]], [[0.5, 0.5], [0.0, 1.0]]]
  result = {"token_expert_distribution": [
      {"layer": l, "distribution": d, "text": ["the", "a longer token text"]}
      for l, d in zip((1, 3), dist)]}
  plots.plot_token_expert_distribution(result, str(tmp_path / "t.png"))
  panels = [ax for ax in figures[0].axes if ax.get_images()]
  assert [ax.get_title() for ax in panels] == ["layer 1", "layer 3"]
  for ax, d in zip(panels, dist):
    np.testing.assert_array_equal(ax.get_images()[0].get_array(), d)
    assert ax.get_images()[0].get_clim() == (0.0, 1.0)
  assert [t.get_text() for t in panels[0].get_yticklabels()] == [
      "'the'", "'a longer toke"]  # repr, cut to 14 characters
  assert [t.get_text() for t in panels[1].get_yticklabels()] == ["", ""]  # once
  load = {"load": [[[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]],  # [task, layer, expert]
                   [[1.0, 0.0, 0.0], [0.0, 0.25, 0.25]]],
          "tasks": ["code", "text"], "layers": [1, 3]}
  plots.plot_domain_load(load, str(tmp_path / "d.png"))
  panels = [ax for ax in figures[1].axes if ax.get_images()]
  assert [ax.get_title() for ax in panels] == ["layer 1", "layer 3"]
  for layer, ax in enumerate(panels):  # rows: tasks; columns: experts
    np.testing.assert_array_equal(ax.get_images()[0].get_array(),
                                  np.array(load["load"])[:, layer])
    assert ax.get_images()[0].get_clim() == (0.0, 1.0)  # the largest load
  assert [t.get_text() for t in panels[0].get_yticklabels()] == ["code", "text"]
  assert [ax.get_ylabel() for ax in panels] == ["task", ""]  # rows named once


def test_drop_curves_per_task_layer_and_choice_at_bucket_centres(figures, tmp_path):
  result = {"bucket_edges": [0, 32, 64], "position_field": "position",
            "by_task": {"code": [0.0, 0.25], "text": [None, 0.5]},
            "by_layer": {"1": [0.1, 0.2]}, "by_choice_rank": {"2": [0.0, 0.4]}}
  plots.plot_drop_by_position(result, str(tmp_path / "p.png"))
  left, right = figures[0].axes
  tasks = _curves(left)
  assert tasks["code"] == ([16.0, 48.0], [0.0, 0.25])
  assert tasks["text"][0] == [16.0, 48.0] and np.isnan(tasks["text"][1][0])
  assert _curves(right) == {"layer 1": ([16.0, 48.0], [0.1, 0.2]),
                            "choice 2 only (all layers)": ([16.0, 48.0], [0.0, 0.4])}
  assert left.get_xlabel() == "position in sequence (bucket centre)"
  assert (left.get_ylabel(), right.get_ylabel()) == ("dropped share of top-k choices",
                                                      "")


def test_stability_curves_by_step_with_chance(figures, tmp_path):
  result = {"steps": [2, 10], "mean_to_final": [0.5, 1.0],
            "mean_consecutive": [None, 0.5], "to_final": {"1": [0.25, 1.0]},
            "chance": 0.125, "num_tokens": 12}
  plots.plot_routing_stability(result, str(tmp_path / "r.png"))
  (ax,) = figures[0].axes
  curves = _curves(ax)
  assert curves["vs final checkpoint"] == ([2, 10], [0.5, 1.0])
  assert np.isnan(curves["vs previous checkpoint"][1][0])
  assert curves["vs previous checkpoint"][1][1] == 0.5
  assert curves["layer 1 vs final"] == ([2, 10], [0.25, 1.0])
  assert curves["chance (1/E = 0.125)"][1] == [0.125, 0.125]
  assert ax.get_ylabel() == "share of 12 frequent tokens\nwith the same top expert"
