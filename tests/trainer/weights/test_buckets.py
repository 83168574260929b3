"""Buckets: bounded sizes, exact round trips of mixed dtypes, a clear error for a tensor too big."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer.weights.buckets import ALIGN, iter_buckets, pack, plan_buckets
from trainer.weights.errors import BucketTooSmallError


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(33, 17, generator=g)),
        ("b.weight", torch.randn(100, generator=g).to(torch.bfloat16)),
        ("c.ids", torch.arange(7)),
        ("d.weight", torch.randn(64, 64, generator=g)),
        ("e.half", torch.randn(3, 5, generator=g).half()),
    ]


def test_round_trip_is_exact_for_every_dtype_and_bounded_in_size() -> None:
    bound = 64 * 64 * 4 + ALIGN
    buckets = list(iter_buckets(weights(), bound))
    assert len(buckets) >= 2 and all(b.nbytes <= bound for b in buckets)
    back = [item for bucket in buckets for item in bucket.tensors()]
    assert [n for n, _ in back] == [n for n, _ in weights()]
    for (name, got), (_, want) in zip(back, weights(), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def test_plan_matches_streaming_and_fails_before_anything_moves() -> None:
    sizes = [(n, t.numel() * t.element_size()) for n, t in weights()]
    plan = plan_buckets(sizes, 64 * 64 * 4 + ALIGN)
    assert plan == [[m.name for m in b.metas] for b in iter_buckets(weights(), 64 * 64 * 4 + ALIGN)]
    with pytest.raises(
        BucketTooSmallError,
        match=r"tensor 'd.weight' needs 16,384 bytes but bucket_bytes=4,096; "
        r"raise the bucket size to at least 16,384 bytes",
    ):
        plan_buckets(sizes, 4096)


def test_streaming_raises_on_the_tensor_that_does_not_fit() -> None:
    stream = iter_buckets(weights(), 3000)
    with pytest.raises(
        BucketTooSmallError, match="tensor 'a.weight' needs 2,244 bytes|tensor 'd.weight'"
    ):
        list(stream)


def test_pack_views_alias_the_one_buffer() -> None:
    bucket = pack(weights()[:2])
    _, first = next(bucket.tensors())
    first.zero_()
    assert int(bucket.buffer[:4].sum()) == 0


def test_a_tied_head_travels_once_in_the_bucket_under_both_names() -> None:
    pytest.importorskip("transformers")
    from tests.trainer.strategies.dist_workers import tiny_qwen2
    from trainer.strategies.hf import HFTrainStrategy

    strategy = HFTrainStrategy(tiny_qwen2(tie=True), trainable=False)
    names = [name for name, _ in strategy.full_weights()]
    assert sorted(names) == sorted(strategy.model.state_dict())  # every name, the head's too
    unique = {id(p): p.numel() * p.element_size() for p in strategy.model.parameters()}
    buckets = list(iter_buckets(strategy.full_weights(), 1 << 20))
    sent = sum(bucket.nbytes for bucket in buckets)
    assert sent < sum(unique.values()) + ALIGN * len(names)  # the embedding's bytes once
    views = dict(item for bucket in buckets for item in bucket.tensors())
    embedding = strategy.model.get_input_embeddings().weight
    assert torch.equal(views["lm_head.weight"], embedding)
    assert torch.equal(views["model.embed_tokens.weight"], embedding)
