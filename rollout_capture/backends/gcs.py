"""Google Cloud Storage (gcsfs): the generic object-store backend, creating with ``ifGenerationMatch=0``.

gcsfs's ``pipe_file(mode="create")`` is one upload carrying that condition (a resumable upload
above 50 MiB, which no capture file reaches); the emulators honour it too (fake-gcs-server, which
gcsfs's own CI runs, at ``STORAGE_EMULATOR_HOST``), and it is proven before it is relied on.
Which of a few journal numbers exist is one ``objects.list`` from the first (``startOffset``).
"""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync as fsspec_sync

from rollout_capture.backends.capabilities import CONDITIONAL_STORE
from rollout_capture.backends.object_store import ObjectStoreBackend
from rollout_capture.secret_options import bare_url


class GCSBackend(ObjectStoreBackend):
    """A capture root in a GCS bucket (or an emulator at ``STORAGE_EMULATOR_HOST``)."""

    capabilities = CONDITIONAL_STORE
    conditional_request = "an upload with ifGenerationMatch=0"

    def endpoint(self) -> str:
        return bare_url(str(getattr(self.fs, "_location", None) or "https://storage.googleapis.com"))

    def _page_from(self, bucket: str, folder: str, first: str, limit: int) -> tuple[set[str], bool]:
        listed: dict[str, Any] = fsspec_sync(
            self.fs.loop,
            self.fs._call,
            "GET",
            "b/{}/o",
            bucket,
            prefix=f"{folder}/",
            delimiter="/",  # a subfolder's names (the claims stream's beside the rows') come as one prefix
            startOffset=first,
            maxResults=limit,
            fields="items(name),nextPageToken",
            json_out=True,
        )
        return {item["name"] for item in listed.get("items", [])}, bool(listed.get("nextPageToken"))
