"""One HTML file a person opens: the evidence of an enriched run, charted and tabled.

Everything is inline (CSS and SVG drawn here, no script, no font, no image, no link out),
so the file works offline, from an artifact store or a mail attachment, and opening it
makes no network request. Charts and tables are drawn from an :class:`EvidenceSummary`
alone, so a flow can write the report from the summed batch summaries without reading
its output again. Failed-call and gap shares above 5 % are shown in red.

The package's face is the names below; ``formatting`` (figures and names as shown),
``charts`` (the SVG charts), ``page`` (the page's sections and the document) and ``files``
(writing it) hold them.
"""

from rollout_capture.report.files import default_report_path, write_report
from rollout_capture.report.page import render_report

__all__ = ["default_report_path", "render_report", "write_report"]
