"""Conversations in and out: ``kvchat import`` (one module per format, each returning
:class:`ImportedSession`) and portable bundles that carry a session's KV."""

from kvchat.transfer.bundle import BundleWritten, write_bundle
from kvchat.transfer.common import BadFile, ImportedMessage, ImportedSession
from kvchat.transfer.importer import FileImport, SessionImport, import_file

__all__ = [
    "BadFile",
    "BundleWritten",
    "FileImport",
    "ImportedMessage",
    "ImportedSession",
    "SessionImport",
    "import_file",
    "write_bundle",
]
