"""Byte-exact cache layouts of DeepSeek V4: the one module that knows where every cache byte lives.

Everything else (allocator sizing, cache writers, KV transfer descriptors, capacity planning) reads the
frozen specs defined here; nothing here imports the model. Facts follow TokenSpeed's DeepSeek V4 cache
(seed 002 and its cache spec); block sizes marked "TokenSpeed's choice" are serving choices, not model facts.

Per layer a request holds (V4-Flash numbers, head_dim 512, rope 64, index_head_dim 128):
- SWA ring of the last `sliding_window` raw tokens, slot = position % window (all layers);
- compressed KV, one row per closed window of `ratio` tokens, full history (ratio 4 and 128 layers);
- indexer keys, one row per compressed entry (ratio-4 layers only);
- compressor state (and, on ratio-4 layers, the indexer's own compressor state): fp32 rows of the
  still-open window(s), a ring of `coff * ratio` rows, slot = position % rows.

Quantized formats (all three keep a block's value rows first, then its scale rows):
- fp8_ds_mla (SWA and compressed KV): value row = nope_dim e4m3 bytes + rope_dim bf16 (576 B); scale
  row = nope_dim / 64 UE8M0 bytes + 1 zero pad byte (8 B) -> 584 B a token;
- indexer MXFP4: index_head_dim / 2 packed e2m1 bytes + index_head_dim / 32 UE8M0 bytes (68 B);
- indexer FP8: index_head_dim e4m3 bytes + one little-endian fp32 scale per 128 values (132 B).
The exact variants (CPU engine) store plain rows in the model dtype and have no scale rows.

Multi-byte fields (bf16 RoPE, fp32 scales) are little-endian, as on every GPU and x86/ARM host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4_kernels import quant_formats as qf

SWA_BLOCK_ROWS = 64  # TokenSpeed's choice (V4_KERNEL_BLOCK_ROWS): rows per SWA / indexer page.
COMPRESSED_BLOCK_TOKENS = 256  # TokenSpeed's choice: one compressed page covers 256 raw tokens.
FP8_DS_MLA_QUANT_BLOCK = 64  # NoPE values per UE8M0 scale.
MXFP4_BLOCK = 32  # e2m1 values per UE8M0 scale.
FP8_INDEXER_BLOCK = 128  # e4m3 values per fp32 scale.
FP32_SCALE_BYTES = 4
# The FP8 indexer writer floors amax / 448 (not amax) at 1e-10.
FP8_INDEXER_AMAX_FLOOR = qf.FP8_E4M3_MAX * 1.0e-10

KV_FORMATS = ("fp8_ds_mla", "exact")
INDEXER_FORMATS = ("mxfp4", "fp8", "exact")


def compressed_block_rows(ratio: int) -> int:
    """Rows per compressed-KV page: 64 at ratio 4, 2 at ratio 128 (TokenSpeed's choice)."""
    if ratio <= 1:
        raise ValueError(f"compress ratio must be > 1, got {ratio}")
    return max(1, COMPRESSED_BLOCK_TOKENS // ratio)


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'float16' / 'float32' (as in config.json) -> torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a floating-point dtype name: {name!r}")
    return dtype


# ---- paged row layouts -------------------------------------------------------------------------
class BlockRowLayout:
    """Shared addressing of a page of `block_size` rows: value rows first, then scale rows.

    Token `pos` of a block owns bytes [value_offset(pos), +value_bytes) and
    [scale_offset(pos), +scale_bytes) of that block. A "packed row" (what the pack_* functions return
    and write_rows / read_rows move) is the value bytes followed by the scale bytes: row_bytes long.
    Global slot s lives in block s // block_size at position s % block_size.
    Subclasses are frozen dataclasses providing value_bytes, scale_bytes and block_size.
    """

    block_size: int

    @property
    def value_bytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define value_bytes")

    @property
    def scale_bytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define scale_bytes")

    @property
    def row_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes

    def block_bytes(self, n: int | None = None) -> int:
        """Bytes of a block of n rows (default block_size); scale rows start at n * value_bytes."""
        return (self.block_size if n is None else n) * self.row_bytes

    def value_offset(self, pos: int) -> int:
        """Byte offset of token `pos`'s value row inside its block."""
        self._check_pos(pos)
        return pos * self.value_bytes

    def scale_offset(self, pos: int) -> int:
        """Byte offset of token `pos`'s scale row inside its block (after ALL value rows)."""
        self._check_pos(pos)
        return self.block_size * self.value_bytes + pos * self.scale_bytes

    def locate(self, slot: int) -> tuple[int, int]:
        """Global slot -> (block index, position in block)."""
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        return divmod(slot, self.block_size)

    def row_byte_offsets(self, slots: torch.Tensor, block_stride: int | None = None) -> torch.Tensor:
        """int64 [N, row_bytes] flat byte offsets of each slot's packed row in a [blocks, stride] cache.

        block_stride defaults to block_bytes(); pools may pad pages, so callers pass cache.stride(0).
        """
        stride = self.block_bytes() if block_stride is None else block_stride
        slots = slots.to(torch.int64).reshape(-1)
        block, pos = slots.div(self.block_size, rounding_mode="floor"), slots.remainder(self.block_size)
        base = block * stride
        value = (base + pos * self.value_bytes)[:, None] + torch.arange(self.value_bytes, device=slots.device)
        scale_base = base + self.block_size * self.value_bytes + pos * self.scale_bytes
        scale = scale_base[:, None] + torch.arange(self.scale_bytes, device=slots.device)
        return torch.cat([value, scale], dim=1)

    def _check_block_size(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def _check_pos(self, pos: int) -> None:
        if not 0 <= pos < self.block_size:
            raise ValueError(f"position {pos} outside a block of {self.block_size} rows")


@dataclass(frozen=True)
class Fp8DsMlaLayout(BlockRowLayout):
    """`fp8_ds_mla` row of SWA and compressed KV.

    value row (token_stride bytes): [nope_dim e4m3 | rope_dim bf16 (2 * rope_dim bytes)];
    scale row (scale_stride bytes): nope_dim / 64 UE8M0 bytes, then one zero pad byte (the seed always
    adds exactly one: 7 -> 8 for V4, which keeps scale rows 8-byte aligned). V4: 576 + 8 = 584 B.
    """

    head_dim: int = 512
    rope_dim: int = 64
    block_size: int = SWA_BLOCK_ROWS

    def __post_init__(self) -> None:
        self._check_block_size()
        if self.rope_dim < 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and >= 0, got {self.rope_dim}")
        if self.nope_dim <= 0 or self.nope_dim % FP8_DS_MLA_QUANT_BLOCK:
            raise ValueError(
                f"head_dim - rope_dim = {self.nope_dim} must be a positive multiple of {FP8_DS_MLA_QUANT_BLOCK}"
            )

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_scales(self) -> int:
        return self.nope_dim // FP8_DS_MLA_QUANT_BLOCK

    @property
    def token_stride(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_stride(self) -> int:
        return self.num_scales + 1

    @property
    def rope_offset(self) -> int:
        """Offset of the bf16 RoPE bytes inside the value row."""
        return self.nope_dim

    # BlockRowLayout's generic names for the same two numbers.
    value_bytes = token_stride
    scale_bytes = scale_stride


@dataclass(frozen=True)
class IndexerKeyLayout(BlockRowLayout):
    """Indexer key row (ratio-4 layers), `fmt` "mxfp4" or "fp8". Scales follow all value rows of a block.

    mxfp4: value row index_head_dim / 2 bytes (e2m1, element 2i in the low nibble), scale row
           index_head_dim / 32 UE8M0 bytes -> 64 + 4 = 68 B for 128;
    fp8:   value row index_head_dim e4m3 bytes, scale row one fp32 per 128 values -> 128 + 4 = 132 B.
    """

    index_head_dim: int = 128
    fmt: str = "mxfp4"
    block_size: int = SWA_BLOCK_ROWS

    def __post_init__(self) -> None:
        self._check_block_size()
        if self.fmt not in ("mxfp4", "fp8"):
            raise ValueError(f"indexer cache format must be 'mxfp4' or 'fp8', got {self.fmt!r}")
        if self.index_head_dim <= 0 or self.index_head_dim % self.scale_block:
            raise ValueError(
                f"{self.fmt} index_head_dim must be a positive multiple of {self.scale_block}, "
                f"got {self.index_head_dim}"
            )

    @property
    def scale_block(self) -> int:
        """Values per scale."""
        return MXFP4_BLOCK if self.fmt == "mxfp4" else FP8_INDEXER_BLOCK

    @property
    def num_scales(self) -> int:
        return self.index_head_dim // self.scale_block

    @property
    def value_bytes(self) -> int:
        return self.index_head_dim // 2 if self.fmt == "mxfp4" else self.index_head_dim

    @property
    def scale_bytes(self) -> int:
        return self.num_scales * (1 if self.fmt == "mxfp4" else FP32_SCALE_BYTES)

    @classmethod
    def from_row_bytes(cls, row_bytes: int, fmt: str, block_size: int = SWA_BLOCK_ROWS) -> IndexerKeyLayout:
        """Recover index_head_dim from a packed row size (68 -> 128 for mxfp4, 132 -> 128 for fp8)."""
        per_block = MXFP4_BLOCK // 2 + 1 if fmt == "mxfp4" else FP8_INDEXER_BLOCK + FP32_SCALE_BYTES
        scale_block = MXFP4_BLOCK if fmt == "mxfp4" else FP8_INDEXER_BLOCK
        if row_bytes <= 0 or row_bytes % per_block:
            raise ValueError(f"{fmt} indexer row bytes must be a positive multiple of {per_block}, got {row_bytes}")
        return cls(row_bytes // per_block * scale_block, fmt, block_size)


@dataclass(frozen=True)
class ExactRowLayout(BlockRowLayout):
    """Unquantized rows of `width` values in `dtype` (CPU engine: compressed KV, indexer keys, SWA).

    No scale rows, so a block is simply block_size contiguous rows.
    """

    width: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = SWA_BLOCK_ROWS

    def __post_init__(self) -> None:
        self._check_block_size()
        if self.width <= 0:
            raise ValueError(f"width must be > 0, got {self.width}")

    @property
    def value_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    scale_bytes = 0


RowLayout = Fp8DsMlaLayout | IndexerKeyLayout | ExactRowLayout


# ---- per-request rings ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressorStateLayout:
    """fp32 compressor state of one request on one layer: a ring of `window_rows` rows.

    A row is [kv_state | score_state], each state_width = coff * head_dim wide (coff 2 with overlap);
    score_state already includes ape[position % ratio]. With overlap, columns [0, head_dim) of a state
    half feed the NEXT window's entry and [head_dim, 2 * head_dim) the token's own window's entry, so
    the ring keeps 2 * ratio rows (8 at ratio 4); without overlap it keeps `ratio` rows (128).
    Position p lives in row p % window_rows. The indexer's state is CompressorStateLayout(4, index_head_dim, True).
    """

    ratio: int
    head_dim: int
    overlap: bool

    def __post_init__(self) -> None:
        if self.ratio <= 1 or self.head_dim <= 0:
            raise ValueError(f"need ratio > 1 and head_dim > 0, got ratio={self.ratio}, head_dim={self.head_dim}")

    dtype = torch.float32

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def state_width(self) -> int:
        return self.coff * self.head_dim

    @property
    def row_floats(self) -> int:
        return 2 * self.state_width

    @property
    def row_bytes(self) -> int:
        return self.row_floats * self.dtype.itemsize

    @property
    def kv_cols(self) -> slice:
        return slice(0, self.state_width)

    @property
    def score_cols(self) -> slice:
        return slice(self.state_width, 2 * self.state_width)

    @property
    def window_rows(self) -> int:
        return self.coff * self.ratio

    @property
    def bytes_per_request(self) -> int:
        return self.window_rows * self.row_bytes

    def slot(self, position: int) -> int:
        return position % self.window_rows

    def live_positions(self, num_tokens: int) -> range:
        """Positions whose rows are still needed after `num_tokens` tokens (what a hand-off must carry).

        The open tail after the last closed window, plus, with overlap, the last closed window itself
        (its first halves feed the next entry): up to ratio - 1 rows, or ratio + ratio - 1 with overlap.
        """
        closed_end = num_tokens - num_tokens % self.ratio
        start = max(0, closed_end - self.ratio) if self.overlap else closed_end
        return range(start, num_tokens)


@dataclass(frozen=True)
class SwaLayout:
    """Sliding-window KV ring of one request on one layer: `window` rows, position p in slot p % window.

    fmt "fp8_ds_mla" stores Fp8DsMlaLayout rows, "exact" stores head_dim values in `dtype`; either way
    the ring is paged in blocks of `block_size` rows (slot s -> block s // block_size).
    """

    window: int = 128
    head_dim: int = 512
    rope_dim: int = 64
    fmt: str = "fp8_ds_mla"
    dtype: torch.dtype = torch.bfloat16
    block_size: int = SWA_BLOCK_ROWS

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.fmt not in KV_FORMATS:
            raise ValueError(f"SWA format must be one of {KV_FORMATS}, got {self.fmt!r}")
        _ = self.row_layout  # builds the row layout once so bad dims fail here, not at first use

    @property
    def row_layout(self) -> Fp8DsMlaLayout | ExactRowLayout:
        if self.fmt == "fp8_ds_mla":
            return Fp8DsMlaLayout(self.head_dim, self.rope_dim, self.block_size)
        return ExactRowLayout(self.head_dim, self.dtype, self.block_size)

    @property
    def row_bytes(self) -> int:
        return self.row_layout.row_bytes

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.window / self.block_size)

    @property
    def bytes_per_request(self) -> int:
        """Bytes of the pages one request's ring occupies (window * row_bytes when block_size divides it)."""
        return self.num_blocks * self.row_layout.block_bytes()

    def slot(self, position: int) -> int:
        return position % self.window

    def live_positions(self, num_tokens: int) -> range:
        return range(max(0, num_tokens - self.window), num_tokens)


# ---- pack / unpack (rows of bytes, no placement) -------------------------------------------------
def _check_2d(x: torch.Tensor, width: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{what} must be [N, {width}], got {tuple(x.shape)}")


def _bytes_as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, k] columns of packed rows -> [N, k / itemsize] dtype, in a dense copy. Not `contiguous().view()`:
    a one-row slice counts as contiguous (a size-1 dimension's stride is ignored), so it keeps the packed row's
    stride and offset, which `view` rejects when they are not multiples of the wider element (a 195-byte fp8 row
    failed on the GPU)."""
    return b.clone(memory_format=torch.contiguous_format).view(dtype)


def pack_fp8_ds_mla(kv: torch.Tensor, layout: Fp8DsMlaLayout) -> torch.Tensor:
    """kv [N, head_dim] float (RoPE already applied) -> uint8 [N, row_bytes] = [value row | scale row].

    Values are rounded to bf16 first (the writers quantize the bf16 latent); each 64-value NoPE block gets
    the scale 2**ceil(log2(amax / 448)); the RoPE tail is stored as raw bf16.
    """
    _check_2d(kv, layout.head_dim, "kv")
    x = kv.to(torch.bfloat16).float()
    codes, exponent = qf.quantize_fp8_pow2(x[:, : layout.nope_dim], FP8_DS_MLA_QUANT_BLOCK)
    rope = x[:, layout.nope_dim :].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = torch.zeros(x.shape[0], layout.scale_stride - layout.num_scales, dtype=torch.uint8, device=x.device)
    return torch.cat([codes, rope, qf.ue8m0_encode(exponent), pad], dim=1)


def unpack_fp8_ds_mla(rows: torch.Tensor, layout: Fp8DsMlaLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, head_dim] in dtype (values are exact in bf16 and wider)."""
    _check_2d(rows, layout.row_bytes, "fp8_ds_mla rows")
    nope = rows[:, : layout.nope_dim]
    rope = _bytes_as(rows[:, layout.rope_offset : layout.token_stride], torch.bfloat16)
    scales = qf.ue8m0_decode(rows[:, layout.token_stride : layout.token_stride + layout.num_scales])
    return torch.cat([qf.dequantize_fp8_pow2(nope, scales), rope.float()], dim=1).to(dtype)


def pack_indexer_mxfp4(k: torch.Tensor) -> torch.Tensor:
    """k [N, index_head_dim] float -> uint8 [N, dim/2 + dim/32] = [packed e2m1 | UE8M0 per 32 values]."""
    if k.dim() != 2:
        raise ValueError(f"indexer keys must be [N, index_head_dim], got {tuple(k.shape)}")
    packed, exponent = qf.quantize_mxfp4(k, MXFP4_BLOCK)
    return torch.cat([packed, qf.ue8m0_encode(exponent)], dim=1)


def unpack_indexer_mxfp4(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, index_head_dim] (dim inferred from row_bytes)."""
    layout = IndexerKeyLayout.from_row_bytes(rows.shape[-1], "mxfp4")
    _check_2d(rows, layout.row_bytes, "mxfp4 indexer rows")
    return qf.dequantize_mxfp4(rows[:, : layout.value_bytes], rows[:, layout.value_bytes :])


def pack_indexer_fp8(k: torch.Tensor) -> torch.Tensor:
    """k [N, index_head_dim] float -> uint8 [N, dim + 4 * dim/128] = [e4m3 | fp32 scale per 128 values]."""
    if k.dim() != 2:
        raise ValueError(f"indexer keys must be [N, index_head_dim], got {tuple(k.shape)}")
    codes, exponent = qf.quantize_fp8_pow2(k, FP8_INDEXER_BLOCK, floor=FP8_INDEXER_AMAX_FLOOR)
    scale = torch.exp2(exponent).contiguous().view(torch.uint8)
    return torch.cat([codes, scale], dim=1)


def unpack_indexer_fp8(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [N, row_bytes] -> float32 [N, index_head_dim] (dim inferred from row_bytes)."""
    layout = IndexerKeyLayout.from_row_bytes(rows.shape[-1], "fp8")
    _check_2d(rows, layout.row_bytes, "fp8 indexer rows")
    scales = _bytes_as(rows[:, layout.value_bytes :], torch.float32)
    return qf.dequantize_fp8_pow2(rows[:, : layout.value_bytes], scales)


def pack_rows(layout: RowLayout, x: torch.Tensor) -> torch.Tensor:
    """Format-agnostic pack: x [N, width] float -> uint8 [N, layout.row_bytes]."""
    if isinstance(layout, Fp8DsMlaLayout):
        return pack_fp8_ds_mla(x, layout)
    if isinstance(layout, IndexerKeyLayout):
        _check_2d(x, layout.index_head_dim, "indexer keys")
        return pack_indexer_mxfp4(x) if layout.fmt == "mxfp4" else pack_indexer_fp8(x)
    _check_2d(x, layout.width, "rows")
    return x.to(layout.dtype).contiguous().view(torch.uint8)


def unpack_rows(layout: RowLayout, rows: torch.Tensor) -> torch.Tensor:
    """Format-agnostic unpack: uint8 [N, row_bytes] -> [N, width] (float32; exact rows keep their dtype)."""
    _check_2d(rows, layout.row_bytes, "packed rows")
    if isinstance(layout, Fp8DsMlaLayout):
        return unpack_fp8_ds_mla(rows, layout)
    if isinstance(layout, IndexerKeyLayout):
        return unpack_indexer_mxfp4(rows) if layout.fmt == "mxfp4" else unpack_indexer_fp8(rows)
    return rows.contiguous().view(layout.dtype)


# ---- placement in paged caches ---------------------------------------------------------------------
def _cache_offsets(cache: torch.Tensor, layout: BlockRowLayout, slots: torch.Tensor):
    """-> (int64 [N, row_bytes] flat byte offsets, bool [N] valid); slots < 0 map to slot 0, invalid."""
    if cache.dtype != torch.uint8:
        raise TypeError(f"cache must be uint8, got {cache.dtype}")
    if cache.dim() != 2 or cache.shape[1] < layout.block_bytes() or not cache.is_contiguous():
        raise ValueError(
            f"cache must be a contiguous [blocks, >= {layout.block_bytes()}] tensor, "
            f"got {tuple(cache.shape)} (contiguous={cache.is_contiguous()})"
        )
    slots = slots.to(torch.int64).reshape(-1)
    valid = slots >= 0
    capacity = cache.shape[0] * layout.block_size
    if bool((slots >= capacity).any()):
        raise ValueError(f"slot out of range: max {int(slots.max())}, cache holds {capacity} slots")
    return layout.row_byte_offsets(slots.clamp_min(0), cache.stride(0)), valid


def write_rows(cache: torch.Tensor, layout: BlockRowLayout, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Scatter packed rows into a paged cache in place; slots < 0 are skipped.

    cache: uint8 [num_blocks, >= block_bytes()] contiguous; slots: int [N]; rows: uint8 [N, row_bytes].
    Only each slot's value bytes and scale bytes are touched.
    """
    offsets, valid = _cache_offsets(cache, layout, slots)
    _check_2d(rows, layout.row_bytes, "packed rows")
    if rows.shape[0] != offsets.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows for {offsets.shape[0]} slots")
    cache.view(-1)[offsets[valid]] = rows[valid].to(torch.uint8)


def read_rows(cache: torch.Tensor, layout: BlockRowLayout, slots: torch.Tensor) -> torch.Tensor:
    """Gather packed rows: -> uint8 [N, row_bytes]; rows of slots < 0 are zero."""
    offsets, valid = _cache_offsets(cache, layout, slots)
    rows = cache.view(-1)[offsets]
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


# ---- whole-model geometry and capacity planning ----------------------------------------------------
@dataclass(frozen=True)
class CacheGeometry:
    """Every layout a DeepSeek V4 model needs, resolved from its config and the chosen cache formats.

    Build with `CacheGeometry.from_config(cfg, kv_format=..., indexer_format=...)`; `cfg` is an
    `engine.model.config.ModelConfig` (only head_dim, rope_dim, index_head_dim, sliding_window,
    compress_ratios and torch_dtype are read).
    """

    compress_ratios: tuple[int, ...]  # per layer, 0 = SWA only
    swa: SwaLayout
    compressed: tuple[tuple[int, RowLayout], ...]  # (ratio, row layout) for each ratio in use
    states: tuple[tuple[int, CompressorStateLayout], ...]  # (ratio, state layout)
    indexer: RowLayout | None  # present iff some layer has ratio 4
    indexer_state: CompressorStateLayout | None

    @classmethod
    def from_config(cls, cfg, kv_format: str = "fp8_ds_mla", indexer_format: str = "mxfp4") -> CacheGeometry:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        if indexer_format not in INDEXER_FORMATS:
            raise ValueError(f"indexer_format must be one of {INDEXER_FORMATS}, got {indexer_format!r}")
        dtype = dtype_from_name(cfg.torch_dtype)
        ratios = tuple(int(r) if r > 1 else 0 for r in cfg.compress_ratios)
        used = sorted({r for r in ratios if r})
        swa = SwaLayout(cfg.sliding_window, cfg.head_dim, cfg.rope_dim, kv_format, dtype)

        def kv_rows(ratio: int) -> RowLayout:
            if kv_format == "fp8_ds_mla":
                return Fp8DsMlaLayout(cfg.head_dim, cfg.rope_dim, compressed_block_rows(ratio))
            return ExactRowLayout(cfg.head_dim, dtype, compressed_block_rows(ratio))

        indexer = indexer_state = None
        if 4 in used:  # ratio-4 layers are the CSA ones, with overlap and a lightning indexer
            # Indexer keys share the ratio-4 compressed pages, so they use the same rows per page.
            rows = compressed_block_rows(4)
            indexer = (
                ExactRowLayout(cfg.index_head_dim, dtype, rows)
                if indexer_format == "exact"
                else IndexerKeyLayout(cfg.index_head_dim, indexer_format, rows)
            )
            indexer_state = CompressorStateLayout(4, cfg.index_head_dim, overlap=True)
        return cls(
            compress_ratios=ratios,
            swa=swa,
            compressed=tuple((r, kv_rows(r)) for r in used),
            states=tuple((r, CompressorStateLayout(r, cfg.head_dim, overlap=(r == 4))) for r in used),
            indexer=indexer,
            indexer_state=indexer_state,
        )

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    def compressed_layout(self, ratio: int) -> RowLayout:
        return dict(self.compressed)[ratio]

    def state_layout(self, ratio: int) -> CompressorStateLayout:
        return dict(self.states)[ratio]

    def _layer_entry_bytes(self, ratio: int) -> int:
        """Bytes one compressed entry costs on a layer of this ratio (KV row + indexer row)."""
        extra = self.indexer.row_bytes if ratio == 4 and self.indexer is not None else 0
        return self.compressed_layout(ratio).row_bytes + extra

    def compressed_bytes_per_token(self) -> float:
        """Average compressed-KV + indexer bytes one raw token adds, summed over all layers."""
        return sum(self._layer_entry_bytes(r) / r for r in self.compress_ratios if r)

    def compressed_bytes(self, num_tokens: int) -> int:
        """Exact compressed-KV + indexer bytes of a request of num_tokens (closed windows only, unpaged)."""
        return sum((num_tokens // r) * self._layer_entry_bytes(r) for r in self.compress_ratios if r)

    def swa_bytes_per_layer(self) -> int:
        return self.swa.bytes_per_request

    def swa_bytes_per_request(self) -> int:
        """SWA ring bytes of one request across all layers (every layer has one)."""
        return self.num_layers * self.swa.bytes_per_request

    def state_bytes_per_request(self) -> int:
        """Compressor (+ indexer compressor) state bytes of one request across all layers."""
        total = 0
        for r in self.compress_ratios:
            if r:
                total += self.state_layout(r).bytes_per_request
                if r == 4 and self.indexer_state is not None:
                    total += self.indexer_state.bytes_per_request
        return total

    def request_bytes(self, num_tokens: int) -> int:
        """Everything one request of num_tokens holds: SWA rings + states + compressed history."""
        return self.swa_bytes_per_request() + self.state_bytes_per_request() + self.compressed_bytes(num_tokens)


def cache_bytes_per_token(cfg, kv_format: str = "fp8_ds_mla", indexer_format: str = "mxfp4") -> float:
    """Compressed KV + indexer bytes per raw token across all layers (V4-Flash, fp8/mxfp4: 3514.25)."""
    return CacheGeometry.from_config(cfg, kv_format, indexer_format).compressed_bytes_per_token()


def swa_bytes_per_request(cfg, kv_format: str = "fp8_ds_mla", per_layer: bool = False) -> int:
    """SWA ring bytes of one request, all layers or (per_layer=True) one layer (V4-Flash fp8: 74752)."""
    geometry = CacheGeometry.from_config(cfg, kv_format)
    return geometry.swa_bytes_per_layer() if per_layer else geometry.swa_bytes_per_request()


def state_bytes_per_request(cfg) -> int:
    """fp32 compressor + indexer-compressor state bytes of one request across all layers."""
    return CacheGeometry.from_config(cfg).state_bytes_per_request()
