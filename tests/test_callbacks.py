import json
import subprocess
import sys
import textwrap

import pytest
import torch

from my_utils.core.memory import MiB
from my_utils.run.callbacks import (SavedActivations, TokenCounter, gather_to_rank0, gradient_bytes, make_callbacks,
                                    memory_breakdown, optimizer_state_bytes)
from my_utils.run.launch import free_port


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def pad_collator(features):
    width = max(len(f) for f in features)
    ids = torch.tensor([[ord(c) for c in f] + [0] * (width - len(f)) for f in features])
    mask = torch.tensor([[1] * len(f) + [0] * (width - len(f)) for f in features])
    return {"input_ids": ids, "attention_mask": mask}


def test_token_counter_counts_and_previews_the_first_batches(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    counter = TokenCounter(pad_collator, tokenizer=CharTokenizer(), preview_batches=1)
    counter(["hello", "hi"])
    counter(["second"])
    assert (counter.tokens, counter.padded_tokens) == (7 + 6, 10 + 6)
    [preview] = counter.previews
    fingerprint = preview.pop("fingerprint")
    assert preview == {"process": 1, "batch_size": 2, "seq_len": 5, "text": "hello"}
    # the whole batch's tokens, not its first example's text: a batch that starts alike still tells apart
    assert capsys.readouterr().out == "[rank 1/2] batch of 2 x 5 tokens on rank 1/2: 'hello'\n"
    other = TokenCounter(pad_collator, tokenizer=CharTokenizer(), preview_batches=1)
    other(["hello", "ho"])
    assert other.previews[0]["text"] == "hello" and other.previews[0]["fingerprint"] != fingerprint
    with pytest.raises(ValueError, match="needs the tokenizer"):
        TokenCounter(pad_collator, preview_batches=1)


def test_gather_without_a_process_group():
    assert gather_to_rank0({"a": 1}) == [{"a": 1}]


def test_gradient_and_adamw_state_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 10)).sum().backward()
    trainable = 20 * 3 + 3
    assert gradient_bytes(model) == 4 * trainable
    assert optimizer_state_bytes(optimizer) == 0  # states are created by the first step
    optimizer.step()
    # two fp32 moments per trainable parameter, and one step counter per parameter tensor
    assert optimizer_state_bytes(optimizer) == 2 * 4 * trainable + 2 * 4


def test_memory_breakdown_cpu_and_cuda():
    cpu_begin = {"allocated": None, "rss": 500 * MiB}
    cpu_end = {"peak_allocated": None, "peak_rss": 800 * MiB}
    b = memory_breakdown(100 * MiB, 10 * MiB, 20 * MiB, cpu_begin, cpu_end)
    assert b == {"weights": 100 * MiB, "gradients": 10 * MiB, "optimizer_states": 20 * MiB,
                 "rest_of_peak": 270 * MiB, "saved_activations": None, "peak": 800 * MiB}
    cuda_begin = {"allocated": 100 * MiB, "rss": 5000 * MiB}
    cuda_end = {"peak_allocated": 400 * MiB, "peak_rss": 9000 * MiB}
    assert memory_breakdown(100 * MiB, 10 * MiB, 20 * MiB, cuda_begin, cuda_end)["rest_of_peak"] == 270 * MiB


def test_saved_activations_counts_what_backward_keeps_without_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1))
    x = torch.randn(4, 10)
    with SavedActivations(model) as saved:
        loss = model(x).sum()
    loss.backward()
    # Linear 1 keeps its input (4x10), tanh its output (4x20), Linear 2 its input (the same 4x20 tensor)
    assert saved.bytes == 4 * (4 * 10 + 4 * 20)
    assert not saved.active
    with SavedActivations(model) as checkpointed:
        loss = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum()
    assert checkpointed.bytes < saved.bytes  # checkpointing keeps the input only, and recomputes the rest


def test_memory_callback_in_one_process():
    memory_cb, metrics_cb = make_callbacks(None, "cpu")
    assert metrics_cb is None
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    memory_cb.on_train_begin(None, None, None)
    memory_cb.on_step_begin(None, None, None, model=model)
    model(torch.randn(2, 8)).sum().backward()
    memory_cb.on_pre_optimizer_step(None, None, None)
    optimizer.step()
    memory_cb.on_optimizer_step(None, None, None, model=model, optimizer=optimizer)
    memory_cb.on_step_end(None, None, None)
    memory_cb.on_train_end(None, None, None, model=model)
    [mine] = memory_cb.report
    assert mine["process"] == 0 and mine["first_step"]["rss"] > 0
    assert mine["breakdown"]["weights"] == 4 * (64 + 8)
    assert mine["breakdown"]["gradients"] == 4 * (64 + 8)
    assert mine["breakdown"]["optimizer_states"] == 8 * (64 + 8) + 2 * 4
    assert mine["breakdown"]["saved_activations"] == 4 * 2 * 8  # the input, kept for the weight's gradient



def test_callbacks_answer_every_trainer_event():
    """The Trainer calls every event on every callback: one a callback does not define does nothing, and a name
    that is no event is still missing."""
    memory_cb, _ = make_callbacks(None, "cpu")
    assert memory_cb.on_evaluate(None, None, None, metrics={}) is None
    with pytest.raises(AttributeError):
        memory_cb.report_path

WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from my_utils.run.callbacks import make_callbacks
    from my_utils.run.cli import run_as_script


    def main():
        dist.init_process_group("gloo")
        assert dist.get_world_size() == 2, dist.get_world_size()
        model = torch.nn.Linear(8, 8 * (1 + dist.get_rank()))  # ranks hold different sizes: reports must differ
        optimizer = torch.optim.AdamW(model.parameters())
        memory_cb, _ = make_callbacks(None, "cpu")
        memory_cb.on_train_begin(None, None, None)
        memory_cb.on_step_begin(None, None, None, model=model)
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        memory_cb.on_pre_optimizer_step(None, None, None)
        optimizer.step()
        memory_cb.on_optimizer_step(None, None, None, model=model, optimizer=optimizer)
        memory_cb.on_step_end(None, None, None)
        memory_cb.on_train_end(None, None, None, model=model)
        if dist.get_rank() == 0:
            with open(sys.argv[1], "w") as f:
                json.dump({"world_size": dist.get_world_size(), "report": memory_cb.report}, f)
        else:
            assert memory_cb.report is None
        dist.destroy_process_group()


    run_as_script(main)  # as every workflow worker ends: gloo's C++ teardown sometimes aborts a finished process
""")


@pytest.mark.slow
def test_memory_report_holds_every_rank_on_two_processes(tmp_path, subprocess_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "report.json"
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                           str(script), str(out)], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert [r["process"] for r in result["report"]] == [0, 1]
    weights = [r["breakdown"]["weights"] for r in result["report"]]
    assert weights == [4 * (8 * 8 + 8), 4 * (8 * 16 + 16)]
    assert all(r["end"]["peak_rss"] > 0 and r["first_step"] is not None for r in result["report"])
