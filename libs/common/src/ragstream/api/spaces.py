"""``GET /v1/spaces`` lists the embedding spaces with the fusion each one's searches use;
``PUT /v1/spaces/{model_key}/fusion`` gives a space fusion weights of its own, ``DELETE`` takes them back."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, Field

from ragstream.core.vectors import vector_blocks
from ragstream.retrieval.fusion import FusionConfig, FusionOrigin, OneFusion, effective_fusion
from ragstream.storage.spaces import EmbeddingSpace, SpaceStatus, SpaceStore

__all__ = ["SpaceView", "spaces_router"]


class SpaceView(BaseModel):
    model_key: Annotated[str, Field(title="Embedding space", description="Model and dimension.")]
    dimension: Annotated[int, Field(title="Vector dimension")]
    status: Annotated[
        SpaceStatus, Field(title="Role", description="active: the default; building: a re-index fills it.")
    ]
    fusion: Annotated[FusionConfig, Field(title="Fusion its searches use")]
    fusion_origin: Annotated[
        FusionOrigin,
        Field(
            title="Where that fusion comes from",
            description="space: set for this space; operator: RAGSTREAM_FUSION*; measured: tuned for this model "
            "(see tuned_on); default: neither.",
        ),
    ]


_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such embedding space"}}


def spaces_router(store: SpaceStore, chosen: OneFusion | None) -> APIRouter:
    """``chosen``: the operator's deployment-wide fusion, which a space's own overrides."""
    router = APIRouter(prefix="/v1/spaces", tags=["spaces"])

    def view(space: EmbeddingSpace) -> SpaceView:
        fusion, origin = effective_fusion(space.model_key, space.fusion, chosen)
        return SpaceView(
            model_key=space.model_key,
            dimension=space.dimension,
            status=space.status,
            fusion=fusion,
            fusion_origin=origin,
        )

    @router.get("", response_model=list[SpaceView])
    async def list_spaces() -> list[SpaceView]:
        """Every embedding space, the active one first."""
        return [view(space) for space in await store.spaces()]

    @router.put("/{model_key}/fusion", response_model=SpaceView, responses=_NOT_FOUND)
    async def set_fusion(model_key: str, fusion: FusionConfig) -> SpaceView:
        """Fuse this space's vector leg with the keyword leg by these weights (from `bench/quality.py
        --tune fusion` on your model, say), whatever the deployment's settings; searches use them at once.
        Weights per block name only blocks of this space's vectors (the bilingual space's ``bge``, ``use``)."""
        blocks = {block.name for block in vector_blocks(model_key)}
        if unknown := sorted(fusion.blocks_named() - blocks):
            raise HTTPException(
                status_code=status.HTTP_422_UNPROCESSABLE_ENTITY,
                detail=f"the vectors of {model_key!r} have no block {', '.join(map(repr, unknown))}"
                f" (their blocks: {', '.join(sorted(blocks)) or 'none, weigh them by vector_weight'})",
            )
        space = await store.set_fusion(model_key, fusion.model_dump())
        if space is None:
            raise HTTPException(status_code=404, detail=f"no embedding space {model_key!r}")
        return view(space)

    @router.delete(
        "/{model_key}/fusion", response_model=SpaceView, status_code=status.HTTP_200_OK, responses=_NOT_FOUND
    )
    async def reset_fusion(model_key: str) -> SpaceView:
        """Back to the operator's, measured or default fusion."""
        space = await store.set_fusion(model_key, None)
        if space is None:
            raise HTTPException(status_code=404, detail=f"no embedding space {model_key!r}")
        return view(space)

    return router
