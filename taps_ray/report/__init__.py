"""The study report, regenerated from the results store alone: README.md, plots, summary.json, results/.

    from taps_ray.report import build_report
    build_report(config)  # -> config.reports_dir / "README.md"
"""

from taps_ray.report.build import build_report

__all__ = ["build_report"]
