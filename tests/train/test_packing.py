"""Packed documents with ``cu_seqlens`` give every document exactly the loss it has alone: no KDA state, conv
window or attention crosses a document boundary."""

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.train.corpus import pack_row
from kimi_linear.train.tasks import IGNORE
from kimi_linear.train.trainer import lm_loss


def test_packed_documents_equal_documents_alone():
    config = preset_config("tiny", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_experts=4, model_max_length=1024)
    model = KimiLinearForCausalLM(config).init_weights(seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 1, 5, 130, 50]                                  # crosses chunk boundaries; a 1-token document
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    ids, labels, kept = pack_row(docs, sum(lengths))
    assert kept == lengths
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with torch.no_grad():
        packed_logits = model(ids[None], cu_seqlens=cu).logits[0]
        for d, a, e in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(d[None]).logits[0]
            assert torch.allclose(packed_logits[a:e], alone, rtol=1e-4, atol=1e-4), (a, e)
            doc_labels = labels[a:e]
            if (doc_labels != IGNORE).any():
                assert abs(lm_loss(packed_logits[a:e], doc_labels).item() - lm_loss(alone, doc_labels).item()) < 1e-5


def test_packed_rows_never_label_across_documents():
    docs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    ids, labels, kept = pack_row(docs, 7)
    assert ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and kept == [3, 2, 2]
    assert labels.tolist() == [2, 3, IGNORE, 5, IGNORE, 7, IGNORE]


def test_packed_source_covers_every_token_of_long_documents():
    """Rows start at pieces of at most seq_len tokens, so an epoch reaches the middle and end of long documents
    (rows that started at whole documents only ever saw their first seq_len tokens)."""
    from kimi_linear.train.corpus import PackedTextSource

    docs = [torch.arange(1000, 1000 + 45), torch.arange(2000, 2000 + 7), torch.arange(3000, 3000 + 30)]
    source = PackedTextSource(docs, [torch.arange(8)], batch_size=2, seq_len=16, seed=1)
    assert len(source.train_pieces) == 3 + 1 + 2                  # 45 -> 16+16+13, 7 -> 7, 30 -> 16+14
    seen = set()
    for step in range(len(source.train_pieces) // 2):             # one epoch
        batch = source.batch(step)
        assert batch["input_ids"].shape == (1, 32) and batch["cu_seqlens"][-1] == 32
        seen |= set(batch["input_ids"].flatten().tolist())
    assert seen >= set(torch.cat(docs).tolist())
    with pytest.raises(ValueError, match="seq_len"):
        PackedTextSource(docs, [torch.arange(8)], batch_size=2, seq_len=0)
