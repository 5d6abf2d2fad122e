"""Byte-level corpus: determinism, user files, batch sampler, outlier batches."""

from __future__ import annotations

import hashlib

import pytest
import torch

from stabstudy.learners import corpus as C


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("STABSTUDY_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(C, "_MEMO", {})


def test_stdlib_corpus_is_deterministic_and_cached(tmp_path):
    a = C.stdlib_bytes(200_000)
    b = C.stdlib_bytes(200_000)
    assert a == b and len(a) == 200_000
    c1 = C.load_corpus("stdlib", max_bytes=200_000)
    assert c1.sha256 == hashlib.sha256(a).hexdigest()
    assert (tmp_path / "data" / "corpus").is_dir()  # cached atomically, no temp files left
    assert not list((tmp_path / "data" / "corpus").glob("*.tmp*"))
    C._MEMO.clear()
    c2 = C.load_corpus("stdlib", max_bytes=200_000)  # from the cache file
    assert c2.sha256 == c1.sha256 and torch.equal(c1.train, c2.train)
    assert c1.train.numel() + c1.val.numel() == 200_000
    assert c1.val.numel() == 20_000
    assert int(c1.train.max()) < 256 and c1.vocab_size == 256


def test_rare_token_is_least_frequent_present_byte():
    c = C.load_corpus("stdlib", max_bytes=200_000)
    counts = torch.bincount(c.train.long(), minlength=256)
    assert counts[c.rare_token] > 0
    assert counts[c.rare_token] == counts[counts > 0].min()


def test_user_text_file_and_unknown_task(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("hello world, " * 200)
    c = C.load_corpus(str(p))
    assert c.name == str(p.resolve()) and c.n_bytes == len("hello world, ") * 200
    with pytest.raises(ValueError, match="unknown LM task"):
        C.load_corpus("shakespeare_char")


def test_edited_file_is_read_again(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("hello world, " * 200)
    a = C.load_corpus(str(p))
    p.write_text("other words, " * 300)
    b = C.load_corpus(str(p))
    assert b.sha256 != a.sha256 and b.n_bytes == len("other words, ") * 300


def test_get_batch_is_seeded_and_shifted():
    data = torch.arange(1000) % 256
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x1, y1 = C.get_batch(data, 8, 16, g1)
    x2, y2 = C.get_batch(data, 8, 16, g2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (8, 16)
    assert torch.equal(y1[:, :-1], x1[:, 1:])
    x3, _ = C.get_batch(data, 8, 16, torch.Generator().manual_seed(4))
    assert not torch.equal(x1, x3)


def test_outlier_batch():
    x = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    ox, oy = C.outlier_batch(x, y, 0.25, 200)
    assert (ox[:2] == 200).all() and (oy[:2] == 200).all()
    assert torch.equal(ox[2:], x[2:]) and not (x == 200).any()  # inputs untouched
    ox, _ = C.outlier_batch(x, y, 0.3, 200)
    assert int((ox == 200).all(dim=1).sum()) == 3  # ceil(0.3 * 8)
    ox, _ = C.outlier_batch(x, y, 1.0, 200)
    assert (ox == 200).all()
    assert C.outlier_batch(x, y, 0.0, 200)[0] is x
    with pytest.raises(ValueError):
        C.outlier_batch(x, y, 1.5, 200)
