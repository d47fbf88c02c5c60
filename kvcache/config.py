"""Configuration of the cache manager (pydantic models: validated once, at the edge).

Strict: a value of the wrong type is an error, never coerced (``"16"``, ``16.0`` or ``True``
are not a ``tokens_per_block``, ``1`` is not ``enable_partial_reuse``); nested tiers and layouts
may still be given as dicts."""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTYPES: Final[frozenset[str]] = frozenset({"float32", "float16", "bfloat16"})


class TierConfig(BaseModel):
    """One memory tier: a name (``device``, ``host``, ...) and how many pages it holds."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(min_length=1, description="tier name, unique within a config")
    num_blocks: int = Field(gt=0, description="pages in this tier (one page holds one block)")


class KVLayout(BaseModel):
    """Shape of the KV data of one page: ``[num_layers, 2, tokens_per_block, heads, head_dim]``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: str = "float16"
    device: str = "auto"

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {value!r}")
        return value


class KVCacheManagerConfig(BaseModel):
    """Everything a :class:`kvcache.manager.KVCacheManager` needs.

    ``tiers`` are ordered fast to slow: tier 0 is the device tier whose pages sequences write.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    tokens_per_block: int = Field(ge=1, description="tokens held by one page")
    tiers: list[TierConfig] = Field(min_length=1, description="memory tiers, fastest first")
    kv_layout: KVLayout | None = None
    enable_partial_reuse: bool = True
    max_partial_scan: int = Field(
        default=32, ge=0, description="children scanned for a partial match"
    )

    @model_validator(mode="after")
    def _unique_tier_names(self) -> KVCacheManagerConfig:
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tier names must be unique, {dupes} appear more than once")
        return self

    def tier_index(self, name: str) -> int:
        """The index of the tier called ``name`` (0 = device tier)."""
        for i, tier in enumerate(self.tiers):
            if tier.name == name:
                return i
        raise KeyError(f"no tier named {name!r}; tiers are {[t.name for t in self.tiers]}")
