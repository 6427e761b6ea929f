"""The zoo: training code people really run, at sizes a CPU traces in seconds, with truth from identity.

transformers models built locally from small configs (no download): a Llama-style and a GPT-2-style decoder
(GPT-2 ties its embeddings to its head) and a BERT-style encoder (masked LM, also tied); PEFT LoRA on a frozen
Llama; HF gradient checkpointing; a custom optimizer whose states are made eagerly, in its constructor, and
kept in its own attributes; one that replaces `p.data` in `step()`; `torch.compile`; gradient accumulation
over two micro-batches; bf16 autocast. Each is traced on real CPU tensors (not FakeTensorMode: the truth is
read off the real objects) and labelled by what each storage is at the end of each step (runner.py).

What differs from the same code on a GPU, and why:
- `torch.compile` uses the `aot_eager_decomp_partition` backend: AOTAutograd's decompositions and min-cut
  partitioner (what is saved for backward is decided as with inductor) with eager aten kernels, because
  inductor's CPU code allocates its buffers with `empty_strided_cpu` outside the dispatcher, where a dispatch
  mode cannot see them (and compiling C++ kernels takes minutes). Compilation itself records nothing (the
  tracer is off while torch.compile runs, as torch's `ignore_compile_internals` modes are).
- bf16 autocast is CPU autocast (`torch.autocast("cpu", dtype=torch.bfloat16)`): its lists differ from CUDA's
  (CUDA autocast runs e.g. softmax, layer_norm and the losses in fp32 and some pointwise ops in the input's
  dtype; the CPU lists cast fewer ops), so the casts and dtypes of some activations differ.
- Attention is PyTorch's SDPA as transformers picks it on a CPU (the math/flash-for-CPU kernel); on a GPU the
  flash or memory-efficient kernels save different tensors for backward.
"""
from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from analyzer.simulate.runner import TrainingLoop

VOCAB = 1024
BATCH = 4
SEQ = 64

#: small configs, as keyword arguments of the transformers config classes (tests rebuild the models from them)
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
GPT2 = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
        "bos_token_id": 0, "eos_token_id": 0}
BERT = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "max_position_embeddings": 128}
LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA), "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT2),
                 "bert": ("BertConfig", "BertForMaskedLM", BERT)}


def available() -> bool:
    """Whether transformers and peft are installed (the `test` extra brings them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft"))


def build(architecture: str) -> torch.nn.Module:
    """A freshly initialised transformers model of the zoo's small config, seeded: the same weights every run."""
    import transformers

    config_name, model_name, kwargs = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config)
    model.train()
    return model


def lora_llama() -> torch.nn.Module:
    """PEFT LoRA adapters on the attention projections of a frozen small Llama."""
    import peft

    model = peft.get_peft_model(build("llama"), peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    model.train()
    return model


def checkpointed_llama() -> torch.nn.Module:
    """A small Llama with HF gradient checkpointing on (each decoder layer recomputed in backward)."""
    model = build("llama")
    # transformers 5 names it activation_checkpointing_enable; gradient_checkpointing_enable is its old name
    enable: Any = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable()
    _config(model).use_cache = False
    return model


def _config(model: torch.nn.Module) -> Any:
    """A transformers model's config (torch's stubs type an undeclared attribute as Tensor | Module)."""
    return model.config


def compiled_llama() -> torch.nn.Module:
    """A small Llama under torch.compile (see the module docstring for the backend)."""
    model = build("llama")
    _config(model).use_cache = False
    compiled = torch.compile(model, backend="aot_eager_decomp_partition")
    assert isinstance(compiled, torch.nn.Module)
    return compiled


# ---- batches: random token ids, made on the device (a GPU run's `.to(device)` makes them there too) ---------
def causal_batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def masked_batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    chosen = torch.rand(BATCH, SEQ, generator=generator) < 0.15
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(chosen, torch.full_like(ids, 3), ids), "attention_mask": torch.ones_like(ids),
            "labels": labels}


# ---- optimizers -------------------------------------------------------------------------------------------
def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (foreach, the default on CUDA)."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3, foreach=True)


class EagerAdam(torch.optim.Optimizer):
    """A hand-written Adam that makes its moments in the constructor and keeps them in its own lists, not in
    `self.state` (as many research codebases do)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        super().__init__([p for p in params if p.requires_grad], {"lr": lr, "betas": betas, "eps": eps})
        self.params = [p for group in self.param_groups for p in group["params"]]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.t += 1
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            if p.grad is None:
                continue
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            m_hat = m / (1 - beta1 ** self.t)
            v_hat = v / (1 - beta2 ** self.t)
            p.sub_(group["lr"] * m_hat / (v_hat.sqrt() + group["eps"]))


class DataReplacingSGD(torch.optim.Optimizer):
    """SGD with momentum and weight decay that writes `p.data = p.data - ...`: every step gives each parameter a
    new storage and frees the old one (momentum buffers in `self.state`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-2, momentum: float = 0.9,
                 weight_decay: float = 0.01) -> None:
        super().__init__([p for p in params if p.requires_grad],
                         {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = p.grad.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                update = state["momentum_buffer"] + group["weight_decay"] * p.data
                p.data = p.data - group["lr"] * update


def eager_adam(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return EagerAdam(params)


def data_replacing_sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return DataReplacingSGD(params)


# ---- the cases --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZooCase:
    name: str
    claim: str
    architecture: str                       # the transformers model underneath (tests rebuild it from its config)
    model_fn: Callable[[], torch.nn.Module]
    batch_fn: Callable[[int], Any] = causal_batch
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = adamw
    micro_batches: int = 1
    autocast: torch.dtype | None = None
    lora: bool = False
    steps: int = 2

    def loop(self) -> TrainingLoop:
        return TrainingLoop(model_fn=self.model_fn, batch_fn=self.batch_fn, optimizer_fn=self.optimizer_fn,
                            micro_batches=self.micro_batches, autocast=self.autocast)

    def model_facts(self) -> dict[str, Any]:
        """What a reader needs to rebuild the model and count its parameters independently."""
        config_name, model_name, kwargs = ARCHITECTURES[self.architecture]
        return {"config_class": config_name, "model_class": model_name, "config": kwargs,
                "lora": LORA if self.lora else None, "micro_batches": self.micro_batches,
                "autocast": str(self.autocast).removeprefix("torch.") if self.autocast else None,
                "optimizer": self.optimizer_fn.__name__}


ZOO: dict[str, ZooCase] = {c.name: c for c in [
    ZooCase("zoo_llama", "a Llama-style decoder (transformers, RMSNorm, rotary, GQA, SwiGLU) trained with AdamW",
            "llama", lambda: build("llama")),
    ZooCase("zoo_gpt2", "a GPT-2-style decoder whose head is tied to its token embedding (one parameter, held "
            "by two modules)", "gpt2", lambda: build("gpt2")),
    ZooCase("zoo_bert", "a BERT-style encoder trained as a masked LM (decoder tied to the word embedding)",
            "bert", lambda: build("bert"), batch_fn=masked_batch),
    ZooCase("zoo_lora", "PEFT LoRA on a frozen Llama: the base is parameters without gradients or optimizer state",
            "llama", lora_llama, lora=True),
    ZooCase("zoo_checkpointing", "HF gradient checkpointing: each decoder layer's activations are recomputed in "
            "backward", "llama", checkpointed_llama),
    ZooCase("zoo_eager_adam", "a custom Adam that makes its moments in its constructor and keeps them in its own "
            "lists", "llama", lambda: build("llama"), optimizer_fn=eager_adam),
    ZooCase("zoo_replace_data", "a custom SGD that assigns `p.data = ...` in step(): every step makes new "
            "parameter storages (on the tied GPT-2)", "gpt2", lambda: build("gpt2"), optimizer_fn=data_replacing_sgd),
    ZooCase("zoo_compile", "torch.compile of a Llama (AOTAutograd's partitioner decides what backward keeps)",
            "llama", compiled_llama),
    ZooCase("zoo_grad_accumulation", "gradient accumulation: two micro-batches' forward and backward per "
            "optimizer step", "llama", lambda: build("llama"), micro_batches=2),
    ZooCase("zoo_bf16_autocast", "bf16 autocast over the forward (fp32 parameters, bf16 casts and activations)",
            "llama", lambda: build("llama"), autocast=torch.bfloat16),
]}
