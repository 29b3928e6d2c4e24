"""Page allocator and cache pool: reference counts, all-or-nothing growth, pages back to idle."""

import pytest
import torch

from engine.loading.make_model import PRESETS
from engine.model.allocator import OutOfPages, PageAllocator
from engine.model.cache import CacheConfig, CachePool
from engine.model.config import ModelConfig


def test_allocator_refcounts_and_free_list():
    alloc = PageAllocator(4, "g")
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    alloc.incref(a[:1])
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 1
    alloc.free(a[:1])
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a[:1])
    with pytest.raises(OutOfPages):
        alloc.allocate(5)
    assert alloc.num_free == 4  # a failed allocation takes nothing


def test_pool_grow_is_all_or_nothing_and_frees_to_idle():
    cfg = ModelConfig.from_dict(PRESETS["tiny"])
    pool = CachePool(cfg, CacheConfig(max_requests=2, max_tokens=512, page_tokens=64), torch.float32, "cpu")
    idle = pool.num_free_pages()
    a, b, c = {}, {}, {}
    pool.grow(a, 300)
    assert len(a["swa"]) == 1 and len(a["kv4"]) == pool.groups["kv4"].spec.pages_for_tokens(300)
    pool.grow(a, 301)  # growing within the same pages takes nothing new
    pool.grow(b, 10)
    before = pool.num_free_pages()
    with pytest.raises(OutOfPages):
        pool.grow(c, 10)  # no third SWA slot
    assert pool.num_free_pages() == before and c == {}
    pool.free(a)
    pool.free(b)
    assert pool.num_free_pages() == idle
