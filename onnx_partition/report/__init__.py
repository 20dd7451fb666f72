"""The HTML report of a plan: :mod:`.page` (the page), :mod:`.charts` (time, memory and schedule
charts), :mod:`.svg` (the SVG primitives), :mod:`.dag_view` (the operator graph coloured by
stage), :mod:`.browser` (headless Chromium for screenshots)."""

from onnx_partition.report.page import default_report_path, report_html, write_report

__all__ = ["default_report_path", "report_html", "write_report"]
