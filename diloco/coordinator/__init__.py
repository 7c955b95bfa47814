"""Coordinator: a small gRPC service that tells each rank who its peers are, records liveness,
progress, round hashes and summaries. It never touches tensors (and never imports torch)."""

from .client import CoordinatorClient
from .errors import CoordinatorError
from .membership import Membership
from .report import format_job_summary, job_summary
from .server import CoordinatorServer

__all__ = ["CoordinatorClient", "CoordinatorError", "CoordinatorServer", "Membership",
           "format_job_summary", "job_summary"]
