"""The batch that moves between roles: its padded layout, and how it crosses process boundaries."""

import pickle

import numpy as np
import pytest
import torch
from cloudrl.trainer.algo.batch import Batch, build_batch, from_wire, position_ids, to_wire


def naive_layout(prompts, responses, pad, logprobs):
    """The layout written out position by position."""
    wp = max(len(p) for p in prompts)
    wr = max(1, max(len(r) for r in responses))
    ids, attn, resp, lps = [], [], [], []
    for p, r, lp in zip(prompts, responses, logprobs):
        row, a = [], []
        for j in range(wp):
            k = j - (wp - len(p))
            row.append(p[k] if k >= 0 else pad)
            a.append(1 if k >= 0 else 0)
        for j in range(wr):
            row.append(r[j] if j < len(r) else pad)
            a.append(1 if j < len(r) else 0)
        ids.append(row)
        attn.append(a)
        resp.append([1.0 if j < len(r) else 0.0 for j in range(wr)])
        lps.append([lp[j] if j < len(r) else 0.0 for j in range(wr)])
    return ids, attn, resp, lps


def test_build_batch_matches_the_layout_written_out():
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[11, 12], [13, 14, 15, 16], []]
    logprobs = [[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6], []]
    batch = build_batch(prompts, responses, pad_id=0, engine_logprobs=logprobs)
    ids, attn, resp, lps = naive_layout(prompts, responses, 0, logprobs)
    assert batch["input_ids"].tolist() == ids
    assert batch["attention_mask"].tolist() == attn
    assert batch["response_mask"].tolist() == resp
    assert torch.allclose(batch["engine_logprobs"], torch.tensor(lps))
    assert batch["input_ids"].dtype == torch.long and batch["response_mask"].dtype == torch.float32
    assert batch.prompt_width == 3
    # positions skip the left padding: the first real token is position 0
    assert position_ids(batch["attention_mask"])[1].tolist()[:4] == [0, 0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_batch_pickles_through_numpy_and_keeps_values(dtype):
    src = Batch(x=(torch.randn(4, 3) * 10).to(dtype), ids=torch.arange(4))
    wire = to_wire(src["x"])
    assert not isinstance(wire, torch.Tensor)  # travels as numpy (bfloat16 as its bits)
    back = pickle.loads(pickle.dumps(src, protocol=5))
    assert isinstance(back, Batch)
    assert back["x"].dtype == dtype and torch.equal(back["x"], src["x"])
    assert torch.equal(back["ids"], src["ids"])


def test_read_only_buffers_come_back_writable():
    frozen = np.arange(6, dtype=np.float32)
    frozen.flags.writeable = False
    t = from_wire(frozen)
    t += 1  # would be undefined behaviour on a read-only buffer
    assert t.tolist() == [1, 2, 3, 4, 5, 6] and frozen.tolist() == [0, 1, 2, 3, 4, 5]
