"""Conversations in and out: ``kvchat import`` (one module per format, each returning
:class:`ImportedSession`) and portable bundles that carry a session's KV."""

from kvchat.transfer.bundle import BundleWritten, write_bundle
from kvchat.transfer.common import BadFile, ImportedDocument, ImportedMessage, ImportedSession
from kvchat.transfer.importer import FileImport, SessionImport, import_file

__all__ = [
    "BadFile",
    "BundleWritten",
    "FileImport",
    "ImportedDocument",
    "ImportedMessage",
    "ImportedSession",
    "SessionImport",
    "import_file",
    "write_bundle",
]
