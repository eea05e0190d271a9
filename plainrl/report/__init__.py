"""The run report: ``plainrl report RUN_DIR [RUN_DIR ...]`` writes one self-contained HTML
file (training curves of the runs overlaid, evaluation with intervals, the configs and
their differences, a rollout browser and the errors); ``log.report`` writes
``run_dir/report.html`` when a run ends.

- :mod:`plainrl.report.data`: reading run directories (:func:`read_run`, :class:`RunDirError`)
- :mod:`plainrl.report.plots`: the charts (matplotlib, inline SVG)
- :mod:`plainrl.report.render`: the page (jinja2 template ``report.html.j2``), :func:`write_report`
"""

from plainrl.report.data import RunData, RunDirError, read_run, read_runs
from plainrl.report.render import render_report, write_report

__all__ = ["RunData", "RunDirError", "read_run", "read_runs", "render_report", "write_report"]
