"""The data role: prompt pool, partial-response pool, experience buffer (see ``service``)."""

from .api import DataApi, DataStatus, Report, ReportReply, SampleRequest, TakeRequest

__all__ = ["DataApi", "DataStatus", "Report", "ReportReply", "SampleRequest", "TakeRequest"]
