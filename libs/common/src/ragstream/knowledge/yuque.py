"""Yuque for the knowledge tool: a doc read whole, and docs created and updated (``POST`` and ``PUT``
of ``/repos/:namespace/docs``, Markdown bodies)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from typing_extensions import override

from ragstream.connectors.yuque import PUBLIC, YuqueClient, YuqueConfig, acl_for, doc_markdown
from ragstream.knowledge.models import ErrorCode
from ragstream.knowledge.platforms import KnowledgeFailure, PlatformDocument, PlatformOperations, WrittenDocument
from ragstream.storage.knowledge import KnowledgeConnection
from ragstream.vendor_http import RetryPolicy

__all__ = ["YuqueOperations"]


class YuqueOperations(PlatformOperations):
    """``external_id`` is ``<namespace>/<doc id>``, as the connector and the live search make it. A
    connection with ``repos`` configured writes only there."""

    platform = "yuque"

    def __init__(self, client: YuqueClient, settings: YuqueConfig) -> None:
        self._client = client
        self._settings = settings

    @classmethod
    def from_connection(
        cls, connection: KnowledgeConnection, *, timeout_s: float, retry: RetryPolicy
    ) -> YuqueOperations:
        token = connection.credentials.get("token")
        if token is None or not token.get_secret_value():
            raise ValueError(f"yuque connection {connection.id} needs credentials token")
        try:
            settings = YuqueConfig.model_validate(connection.config)
        except ValidationError:
            raise ValueError(f"yuque connection {connection.id}: invalid config (base_url, repos)") from None
        return cls(YuqueClient(token, base_url=settings.base_url, timeout_s=timeout_s, retry=retry), settings)

    @override
    async def aclose(self) -> None:
        await self._client.aclose()

    @override
    async def read(self, external_id: str) -> PlatformDocument:
        namespace, doc_id = _split(external_id)
        repo = await self._client.repo(namespace)
        doc = await self._client.doc(namespace, doc_id)
        return PlatformDocument(
            external_id=external_id,
            title=str(doc.get("title") or doc_id),
            text=await doc_markdown(doc),
            knowledge_base=str(repo.get("name") or namespace),
            url=self._url(namespace, doc),
            acl=acl_for(namespace, repo.get("public"), doc.get("public")),
        )

    @override
    async def target(self, knowledge_base: str | None) -> tuple[str, tuple[str, ...] | None]:
        repos = self._settings.repos or []
        if knowledge_base is None:
            if len(repos) != 1:
                raise KnowledgeFailure(
                    ErrorCode.INVALID_REQUEST,
                    "name the repo to write to as knowledge_base (a namespace group/book)"
                    + (f"; this connection's repos: {', '.join(repos)}" if repos else ""),
                )
            knowledge_base = repos[0]
        if self._settings.repos is not None and knowledge_base not in repos:
            raise KnowledgeFailure(
                ErrorCode.FORBIDDEN, f"repo {knowledge_base} is not one of this connection's: {', '.join(repos)}"
            )
        _split(f"{knowledge_base}/0")
        repo = await self._client.repo(knowledge_base)
        # Writing takes seeing the repo: a private one needs its group, as its documents do.
        return knowledge_base, acl_for(knowledge_base, repo.get("public"), PUBLIC)

    @override
    async def create(self, knowledge_base: str, title: str, body: str) -> WrittenDocument:
        repo = await self._client.repo(knowledge_base)
        doc = await self._client.create_doc(knowledge_base, title, body)
        return self._written(knowledge_base, repo, doc, title)

    @override
    async def update(self, external_id: str, title: str | None, body: str) -> WrittenDocument:
        namespace, doc_id = _split(external_id)
        repo = await self._client.repo(namespace)
        doc = await self._client.update_doc(namespace, doc_id, body, title=title)
        return self._written(namespace, repo, doc, title or doc_id)

    def _written(self, namespace: str, repo: dict[str, Any], doc: dict[str, Any], title: str) -> WrittenDocument:
        return WrittenDocument(
            external_id=f"{namespace}/{doc['id']}",
            title=str(doc.get("title") or title),
            knowledge_base=str(repo.get("name") or namespace),
            url=self._url(namespace, doc),
        )

    def _url(self, namespace: str, doc: dict[str, Any]) -> str:
        return f"{self._settings.base_url.rstrip('/')}/{namespace}/{doc.get('slug') or doc.get('id')}"


def _split(external_id: str) -> tuple[str, str]:
    parts = external_id.split("/")
    if len(parts) != 3 or not all(parts):
        raise KnowledgeFailure(ErrorCode.NOT_FOUND, f"no Yuque document {external_id!r} (expected group/book/id)")
    return f"{parts[0]}/{parts[1]}", parts[2]
