"""Azure Blob Storage (adlfs): the generic object-store backend, creating with one conditional Put Blob.

A create is one Put Blob with ``If-None-Match: *`` (azure-storage-blob's ``overwrite=False``),
made through adlfs's own service client whatever adlfs's ``pipe_file`` does with ``mode``; an
existing blob answers 409 ``BlobAlreadyExists``, raised as ``FileExistsError``. Listings and reads
are adlfs's. Credentials come the Azure way, from the environment adlfs reads
(``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with a key, a SAS token,
a service principal or ``DefaultAzureCredential``), never from storage options. Which of a
few journal numbers exist is one List Blobs from the first (``startFrom``); a file is removed by
one Delete Blob (adlfs's ``rm`` looks at each first).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from fsspec.asyn import sync as fsspec_sync

from rollout_capture.backends.capabilities import CONDITIONAL_STORE
from rollout_capture.backends.object_store import ObjectStoreBackend
from rollout_capture.secret_options import bare_url


class AzureBackend(ObjectStoreBackend):
    """A capture root in an Azure Blob container (``az://container/prefix``, ``abfs://``; Azurite too)."""

    capabilities = CONDITIONAL_STORE
    conditional_request = "Put Blob with If-None-Match: *"

    def endpoint(self) -> str:
        """The account's URL, bare: a SAS token (``AZURE_STORAGE_SAS_TOKEN``, a connection string's
        ``SharedAccessSignature=``) rides in the service client's URL as its query."""
        client = getattr(self.fs, "service_client", None)
        url = getattr(client, "url", None) or getattr(self.fs, "account_url", None)
        return bare_url(str(url or f"https://{getattr(self.fs, 'account_name', '?')}.blob.core.windows.net"))

    def create_unproven(self, path: str, data: bytes) -> None:
        fsspec_sync(self.fs.loop, self._put_blob_if_absent, path, data)

    async def _put_blob_if_absent(self, path: str, data: bytes) -> None:
        from azure.core.exceptions import ResourceExistsError

        container, blob, _ = self.fs.split_path(path)
        async with self.fs.service_client.get_blob_client(container=container, blob=blob) as client:
            try:
                await client.upload_blob(data, overwrite=False)  # one Put Blob, If-None-Match: *
            except ResourceExistsError:
                raise FileExistsError(path) from None

    def _page_from(self, bucket: str, folder: str, first: str, limit: int) -> tuple[set[str], bool]:
        result: tuple[set[str], bool] = fsspec_sync(
            self.fs.loop, self._list_from, bucket, folder, first, limit
        )
        return result

    async def _list_from(self, container: str, folder: str, first: str, limit: int) -> tuple[set[str], bool]:
        async with self.fs.service_client.get_container_client(container) as client:
            pages: Any = client.walk_blobs(  # a subfolder's names (the claims stream's) come as one prefix
                name_starts_with=f"{folder}/", delimiter="/", start_from=first, results_per_page=limit
            ).by_page()
            try:
                page = await pages.__anext__()
            except StopAsyncIteration:
                return set(), False
            names = {blob.name async for blob in page}
            return names, pages.continuation_token is not None

    def remove(self, paths: Sequence[str]) -> None:
        if paths:
            fsspec_sync(self.fs.loop, self._delete_blobs, list(paths))

    async def _delete_blobs(self, paths: list[str]) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        gate = asyncio.Semaphore(self.concurrency)

        async def one(path: str) -> None:
            container, blob, _ = self.fs.split_path(path)
            async with gate, self.fs.service_client.get_blob_client(container=container, blob=blob) as client:
                with contextlib.suppress(ResourceNotFoundError):  # absent ones are fine
                    await client.delete_blob()

        await asyncio.gather(*(one(path) for path in paths))
