"""Training through kernels_lib.hf: Transformers' Trainer, an AdamW loop, torch.compile, TRL's SFTTrainer.

Tiny models (``hf_models``), float32, CPU (the kernels in Triton's interpreter), seeded. Each test runs the
same training twice, the model unpatched (or with TRL's fused head) and patched (or with ours), and compares
what is logged at every step and the weights at the end. Per-step gradients agree to ~1e-6 relative (see
test_hf.py); AdamW normalizes each update, so a difference that small moves a weight by far less than the
learning rate, and the runs stay within the tolerances stated at each test over 4-24 steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from hf_models import DEVICE, VOCAB, assert_grads_close, batch, loss_and_grads, rel_err, tiny_model

from kernels_lib import hf

USE_CPU = DEVICE.type == "cpu"


def _token_rows(n_rows: int, seq_len: int, seed: int):
    """``n_rows`` examples of random token ids, their lengths varying from ``seq_len // 2`` to ``seq_len``."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (n_rows,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


# --------------------------------------------------------------------------- transformers.Trainer


def _trainer_log(tmp_path, patched: bool):
    """Train 4 optimizer steps of 2 micro-batches of 2 rows (gradient accumulation), padded rows included; return
    the log (loss and grad norm at every step) and the final weights."""
    model = tiny_model("llama")
    if patched:
        hf.patch(model)
    rows = []
    for ids in _token_rows(16, 12, seed=7):
        pad = 12 - len(ids)
        rows.append({
            "input_ids": ids + [0] * pad,
            "attention_mask": [1] * len(ids) + [0] * pad,
            "labels": ids + [-100] * pad,
        })
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("patched" if patched else "unpatched")),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=USE_CPU,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    assert trainer.model_accepts_loss_kwargs  # so Trainer passes num_items_in_batch to the forward
    trainer.train()
    log = [entry for entry in trainer.state.log_history if "loss" in entry]
    return log, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_with_gradient_accumulation_logs_the_same_losses(tmp_path):
    """Logged loss at each of the 4 steps within 1e-5 relative, gradient norm within 1e-4, final weights within
    1e-5 relative (the patched forward is what Trainer calls: no logits formed, num_items_in_batch honoured)."""
    ref_log, ref_weights = _trainer_log(tmp_path, patched=False)
    log, weights = _trainer_log(tmp_path, patched=True)
    assert len(log) == len(ref_log) == 4
    for entry, ref in zip(log, ref_log):
        assert abs(entry["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (entry, ref)
        assert abs(entry["grad_norm"] - ref["grad_norm"]) <= 1e-4 * abs(ref["grad_norm"]), (entry, ref)
    assert ref_log[-1]["loss"] < ref_log[0]["loss"]  # it trains
    assert_grads_close(weights, ref_weights, 1e-5)


def _evaluate(tmp_path, patched: bool, keep_logits=None):
    """``Trainer.evaluate`` with a ``compute_metrics`` that reads the predictions (next-token accuracy by argmax,
    the mean of each position's largest logit)."""
    model = tiny_model("llama")
    if patched:
        hf.patch(model, keep_logits=keep_logits)
    rows = []
    for ids in _token_rows(6, 12, seed=5):
        pad = 12 - len(ids)
        rows.append({"input_ids": ids + [0] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                     "labels": ids + [-100] * pad})
    seen = {}

    def compute_metrics(prediction):
        logits, labels = prediction.predictions, prediction.label_ids
        seen["shape"] = logits.shape
        hits = logits[:, :-1].argmax(-1) == labels[:, 1:]
        valid = labels[:, 1:] != -100
        return {"accuracy": float(hits[valid].mean()), "mean_top_logit": float(logits.max(-1).mean())}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"eval-{patched}-{keep_logits}"), per_device_eval_batch_size=4, report_to=[],
        use_cpu=USE_CPU, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=rows, compute_metrics=compute_metrics)
    return trainer.evaluate(), seen


def test_trainer_evaluate_gives_compute_metrics_the_logits(tmp_path):
    """``Trainer.evaluate(compute_metrics=...)`` on the patched model: the metrics get the logits (eval mode, no
    grad: the default ``keep_logits=None`` forms them), and the eval loss and accuracy are the unpatched model's.
    With ``keep_logits=False`` there are none, and the user's metric fails as it did before (the choice said)."""
    ref, ref_seen = _evaluate(tmp_path, patched=False)
    got, seen = _evaluate(tmp_path, patched=True)
    assert seen["shape"] == ref_seen["shape"] == (6, 12, VOCAB)
    assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-5 * ref["eval_loss"], (got, ref)
    assert got["eval_accuracy"] == ref["eval_accuracy"]
    assert abs(got["eval_mean_top_logit"] - ref["eval_mean_top_logit"]) <= 1e-6 * abs(ref["eval_mean_top_logit"])
    with pytest.raises(AttributeError, match="'tuple' object has no attribute"):
        _evaluate(tmp_path, patched=True, keep_logits=False)


# --------------------------------------------------------------------------- convergence (Liger's mini-model test)


def _adamw_run(family: str, tied: bool, patched: bool, steps: int = 24):
    """AdamW on a fixed synthetic stream (a repeated 8-token motif with random tokens mixed in), batch 2 x 16."""
    model = tiny_model(family, tied=tied, layers=2)
    model.train()
    if patched:
        hf.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(11)
    motif = torch.randint(3, VOCAB, (8,), generator=generator)
    losses = []
    for _ in range(steps):
        input_ids = motif.repeat(2, 2).clone()
        noise = torch.rand(input_ids.shape, generator=generator) < 0.2
        input_ids[noise] = torch.randint(3, VOCAB, (int(noise.sum()),), generator=generator)
        input_ids = input_ids.to(DEVICE)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses), {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)], ids=["llama-untied", "qwen2-tied"])
def test_convergence_matches_unpatched(family, tied):
    """As Liger-Kernel's fp32 mini-model convergence tests: 24 AdamW steps with and without the patch; the loss
    at every step within rtol 1e-5 (atol 1e-6), every final weight within rtol 1e-4, atol 1e-5 elementwise
    (Liger's fp32 bounds: loss rtol 1e-5, params atol 5e-3), and the loss falls by at least a third."""
    ref_losses, ref_weights = _adamw_run(family, tied, patched=False)
    losses, weights = _adamw_run(family, tied, patched=True)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-4, atol=1e-5, msg=name)
    assert ref_losses[-4:].mean() < 2 / 3 * ref_losses[:4].mean()


# --------------------------------------------------------------------------- torch.compile


def test_torch_compile_one_graph_break():
    """``torch.compile(model)`` of the patched model: loss and every gradient as the unpatched eager model's
    (LOSS 1e-5, gradients 1e-4 relative), with one graph break, at the loss (kernels_lib.hf._with_full_head, wrapped in
    ``torch.compiler.disable``); the backbone is one graph. Backend ``aot_eager`` (Dynamo + AOTAutograd,
    no code generation): Inductor compiles C++ on CPU, ~40 s here, and gave the same result when tried."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    input_ids, attention_mask, labels = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    hf.patch(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    loss = compiled(**inputs).loss
    loss.backward()
    assert rel_err(loss, ref_loss) < 1e-5
    assert_grads_close({name: p.grad for name, p in model.named_parameters()}, ref_grads, 1e-4)
    # Dynamo records the one break once per nested frame it unwinds (forward -> dispatch -> loss forward).
    breaks = counters["graph_break"]
    # The break is at the loss: kernels_lib.hf._with_full_head (the head gathered where FSDP2 / ZeRO-3
    # shard it, then fused_linear_cross_entropy), wrapped in torch.compiler.disable.
    assert breaks and all("_with_full_head" in reason for reason in breaks), dict(breaks)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**inputs)
    assert explanation.graph_count == 1
    assert len(explanation.break_reasons) == 1
    assert "torch.compiler.disable" in explanation.break_reasons[0].reason
    torch._dynamo.reset()


# --------------------------------------------------------------------------- TRL's SFTTrainer


def _word_level_tokenizer():
    """A tokenizer built here (no download): one word per token id, ``<pad>``, ``<bos>``, ``<eos>`` first."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def _sft_log(tmp_path, model, ours: bool):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_dict({"input_ids": _token_rows(12, 14, seed=3)})  # already tokenized
    args = SFTConfig(
        output_dir=str(tmp_path / ("ours" if ours else "trl")),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=USE_CPU,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    if ours:
        with hf.use_in_trl():
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_word_level_tokenizer())
        assert hf.is_patched(model)
    else:
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=_word_level_tokenizer())
        assert not hf.is_patched(model)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trainer_with_our_fused_head(tmp_path):
    """TRL 1.16's SFTTrainer, unchanged, with its own fused head and with ours (built inside ``hf.use_in_trl()``):
    3 steps with gradient accumulation; the logged loss and ``mean_token_accuracy`` within 1e-5 relative, the
    ``entropy`` within 1e-4, at every step."""
    model = tiny_model("gemma2")  # softcap on, to take the softcap path of both heads
    ref_log = _sft_log(tmp_path, copy.deepcopy(model), ours=False)
    log = _sft_log(tmp_path, model, ours=True)
    assert len(log) == len(ref_log) == 3
    for entry, ref in zip(log, ref_log):
        for key, tol in (("loss", 1e-5), ("mean_token_accuracy", 1e-5), ("entropy", 1e-4)):
            assert abs(entry[key] - ref[key]) <= tol * abs(ref[key]), (key, entry, ref)
    assert ref_log[-1]["loss"] < ref_log[0]["loss"]
