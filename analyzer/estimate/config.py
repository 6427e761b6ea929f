"""What `analyze estimate` is told about a training job: the model's shape, how it is split over GPUs, its precision
and what it recomputes, as one typed value, read from the formats people already have: Megatron-LM's arguments
(a `model_config.yaml` with `MODEL_ARGS:`, as its functional tests keep them, or the same `--flag: value` pairs),
or a Hugging Face `config.json`.

Defaults are Megatron-LM's own (megatron/training/arguments.py): the FFN is 4h, or int(8h/3 / 64)·64 with SwiGLU;
kv_channels h/heads; dropout 0.1; the vocabulary padded to a multiple of 128·TP; expert TP = TP; gradients
accumulated and reduced in fp32 under bf16 (fp16: in fp16, unless --accumulate-allreduce-grads-in-fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from analyzer.errors import AnalyzerError

#: the tokenizers of Megatron-LM's functional tests whose vocabulary is known without the tokenizer file
KNOWN_VOCABULARIES = {"gpt2_bpe": 50257, "nemotron_2_256k": 256000, "llama2": 32000, "qwen3": 151669}
PRECISIONS = ("bf16", "fp16", "fp32")
MAX_STAGES = 1024             # pipeline stages (and layers a stage) one estimate lists
MAX_CONFIG_BYTES = 1 << 20
MAX_SIZE = 1 << 31            # any one size or degree    # a model_config.yaml or config.json is a few kilobytes
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class MoE:
    """Mixture of experts: routed experts of `ffn` width, `top_k` a token, `shared_ffn` a shared expert's width."""

    experts: int
    top_k: int = 2
    ffn: int | None = None                  # default: the dense FFN width
    shared_ffn: int = 0
    capacity_factor: float | None = None    # None: dropless
    layer_pattern: tuple[int, ...] | None = None   # 1 where a layer is MoE; None: every layer
    router_fp32: bool = False
    dispatcher: str = "allgather"           # Megatron's default; alltoall | flex keep no gathered copy


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention: queries and keys/values through low-rank latents, with a RoPE part apart."""

    kv_lora: int
    q_lora: int | None = None               # None: queries projected directly
    qk_head: int = 128
    qk_pos: int = 64
    v_head: int = 128


@dataclass(frozen=True)
class TrainingConfig:
    """A Megatron-style training job. Sizes are counts; `gpus` is the world size (DP = gpus / (TP·PP·CP))."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    vocab: int                              # before padding
    gpus: int = 1
    global_batch: int | None = None         # None: one micro-batch per data-parallel rank
    query_groups: int | None = None         # GQA; None: as many as heads
    kv_channels: int | None = None
    ffn: int | None = None
    swiglu: bool = False
    normalization: str = "LayerNorm"        # or RMSNorm
    bias: bool = True
    qk_layernorm: bool = False
    position_embedding: str = "learned_absolute"   # rope | none
    max_position: int | None = None
    untied: bool = False
    vocab_divisor: int = 128
    tp: int = 1
    pp: int = 1
    vp: int = 1                             # model chunks per pipeline stage (interleaved 1F1B)
    vp_group: int | None = None             # micro-batches per virtual-stage group; None: PP
    cp: int = 1
    ep: int = 1
    etp: int | None = None                  # expert TP; None: TP
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    embedding_as_layer: bool = False        # the pipeline split counts the embedding as a layer (first chunk)
    loss_as_layer: bool = False             # and the output layer with the loss (last chunk)
    distributed_optimizer: bool = False
    optimizer_instances: int = 1            # distributed-optimizer replicas: each shards over DP / instances
    zero: int = 0                           # 2: gradients sharded over DP too, 3: weights too (FSDP)
    precision: str = "bf16"
    fp8: bool = False
    grad_fp32: bool | None = None           # None: fp32 under bf16, the parameters' dtype otherwise
    recompute: str = "none"
    recompute_method: str = "uniform"       # uniform | block
    recompute_layers: int = 1
    flash_attention: bool = True
    softmax_fp32_copy: bool = False         # unfused softmax computed in fp32 outside the fused kernel
    cross_entropy_fusion: bool = False      # the fused loss keeps one more fp32 copy of the logits
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    moe: MoE | None = None
    mla: MLA | None = None

    @property
    def dp(self) -> int:
        return max(self.gpus // (self.tp * self.pp * self.cp), 1)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return max(self.gpus // (self.expert_tp * self.ep * self.pp), 1)

    @property
    def groups(self) -> int:
        return self.heads if self.query_groups is None else self.query_groups

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.kv_channels is None else self.kv_channels

    @property
    def ffn_width(self) -> int:
        if self.ffn is not None:
            return self.ffn
        return int(4 * self.hidden * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden

    @property
    def padded_vocab(self) -> int:
        """Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by × TP."""
        multiple = self.vocab_divisor * self.tp
        return math.ceil(self.vocab / multiple) * multiple

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and data-parallel rank."""
        if not self.global_batch:
            return 1
        return max(self.global_batch // (self.micro_batch * self.dp), 1)

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        fp32 = self.grad_fp32 if self.grad_fp32 is not None else self.precision in ("bf16", "fp32")
        return 4 if fp32 else 2

    def check(self, source: str | None = None) -> TrainingConfig:
        """One clear line for a configuration Megatron would refuse."""
        def bad(what: str, fix: str) -> AnalyzerError:
            return AnalyzerError(source, what, fix)
        for name in ("layers", "hidden", "heads", "seq", "micro_batch", "vocab", "gpus", "tp", "pp", "vp", "cp", "ep",
                     "vocab_divisor", "groups", "head_dim", "ffn_width", "recompute_layers", "optimizer_instances",
                     "expert_tp"):
            if getattr(self, name) < 1:
                raise bad(f"{name} is {getattr(self, name)}", "Every size and parallel degree is a positive count.")
            if getattr(self, name) > MAX_SIZE:
                raise bad(f"{name} is {getattr(self, name)}", f"Sizes above {MAX_SIZE} are not estimated.")
        if self.pp > MAX_STAGES or self.layers > MAX_STAGES * 100:
            raise bad(f"{self.pp} pipeline stages of {self.layers} layers", f"At most {MAX_STAGES} stages and "
                      f"{MAX_STAGES * 100} layers are estimated.")
        if self.gpus % (self.tp * self.pp * self.cp):
            raise bad(f"{self.gpus} GPUs are not a multiple of TP×PP×CP = {self.tp * self.pp * self.cp}",
                      "Give --gpus as TP×PP×CP×DP.")
        if self.heads % self.tp or self.groups % self.tp and self.tp % self.groups:
            raise bad(f"{self.heads} heads ({self.groups} query groups) do not split over TP {self.tp}",
                      "Tensor parallelism splits the heads: use a TP that divides them.")
        units = self.layers + self.embedding_as_layer + self.loss_as_layer
        if units % (self.pp * self.vp) and self.first_stage_layers is None and self.last_stage_layers is None:
            raise bad(f"{self.layers} layers do not split into {self.pp} stages × {self.vp} chunks",
                      "Use a pipeline size (and virtual stages) that divides the layers.")
        if self.precision not in PRECISIONS:
            raise bad(f"precision {self.precision}", f"Use one of {', '.join(PRECISIONS)}.")
        if self.recompute not in RECOMPUTE:
            raise bad(f"recompute {self.recompute}", f"Use one of {', '.join(RECOMPUTE)}.")
        if self.moe is not None and not (1 <= self.moe.top_k <= self.moe.experts):
            raise bad(f"top-k {self.moe.top_k} of {self.moe.experts} experts", "Route each token to 1 to all experts.")
        if self.moe is not None and self.moe.capacity_factor is not None and not self.moe.capacity_factor > 0:
            raise bad(f"capacity factor {self.moe.capacity_factor}", "Give a positive capacity factor, or none.")
        if self.moe is not None and self.moe.experts % self.ep:
            raise bad(f"{self.moe.experts} experts do not split over EP {self.ep}", "Use an EP that divides them.")
        if (self.gpus // self.pp) % (self.ep * self.expert_tp):
            raise bad(f"EP {self.ep} × expert TP {self.expert_tp} does not divide the {self.gpus // self.pp} GPUs of a "
                      "pipeline stage", "Use an EP and expert TP whose product divides GPUs / PP.")
        if self.seq % (2 * self.cp) and self.cp > 1:
            raise bad(f"sequence {self.seq} does not split into 2 × CP {self.cp} chunks",
                      "Context parallelism splits the sequence in 2·CP chunks: use a CP that divides seq / 2.")
        return self


class Unsupported(Exception):
    """A configuration the model does not describe, with the one-line reason."""


def _flag(args: dict[str, Any], name: str) -> bool:
    value = args.get(name, False)
    return value is True or str(value).lower() in ("true", "1", "yes")


def _int(args: dict[str, Any], name: str, default: int | None = None) -> int | None:
    value = args.get(name)
    if value is None or value is False:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise Unsupported(f"{name} is {value!r}, not a number") from None


def _float(args: dict[str, Any], name: str, default: float) -> float:
    value = args.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise Unsupported(f"{name} is {value!r}, not a number") from None
    if not math.isfinite(number) or number < 0:
        raise Unsupported(f"{name} is {value!r}, not a finite share")
    return number


def megatron_vocab(args: dict[str, Any]) -> int:
    """The tokenizer's vocabulary, as Megatron's tokenizer would report it (before padding)."""
    kind = str(args.get("--tokenizer-type") or "")
    model = str(args.get("--tokenizer-model") or "")
    if kind == "NullTokenizer":
        size = _int(args, "--vocab-size")
        if size is None:
            raise Unsupported("NullTokenizer without --vocab-size")
        return size + 1            # NullTokenizer adds the end-of-document token
    if _int(args, "--vocab-size") is not None:
        return _int(args, "--vocab-size") or 0
    if kind in ("", "GPT2BPETokenizer") and str(args.get("--vocab-file", "")).endswith("vocab.json") \
            and args.get("--merge-file"):
        return KNOWN_VOCABULARIES["gpt2_bpe"]
    for name, size in KNOWN_VOCABULARIES.items():
        if name in model or (name == "llama2" and kind == "Llama2Tokenizer") or (name == "qwen3" and "qwen3" in model):
            return size
    raise Unsupported(f"the vocabulary of tokenizer {kind or 'default'} {Path(model).name or ''} is not known: "
                      "give --vocab".replace("  ", " "))


#: arguments of features the model does not describe, with the reason it says
UNSUPPORTED_FLAGS = {
    "--hybrid-layer-pattern": "hybrid Mamba layers are not modelled",
    "--hybrid-override-pattern": "hybrid Mamba layers are not modelled",
    "--is-hybrid-model": "hybrid Mamba layers are not modelled",
    "--use-megatron-fsdp": "Megatron FSDP is not modelled",
    "--fine-grained-activation-offloading": "activation offloading is not modelled",
    "--mtp-num-layers": "multi-token prediction layers are not modelled",
    "--perform-rl-step": "an RL loop (inference and training) is not modelled",
    "--cuda-graph-impl": "CUDA graphs' static buffers are not modelled",
    "--pipeline-model-parallel-layout": "a custom pipeline layout is not modelled",
    "--moe-latent-size": "latent MoE is not modelled",
    "--flextron": "Flextron elastic training is not modelled",
    "--export-kd-teacher-load": "knowledge distillation's teacher model is not modelled",
    "--defer-embedding-wgrad-compute": "deferred embedding weight gradients are not modelled",
}


def from_megatron_args(args: dict[str, Any], gpus: int | None = None) -> TrainingConfig:
    """A TrainingConfig from Megatron-LM's arguments (`--num-layers: 12` pairs, as in MODEL_ARGS). Raises
    Unsupported with the reason for a feature the model does not describe."""
    for flag, reason in UNSUPPORTED_FLAGS.items():
        if args.get(flag) not in (None, False, "false"):
            raise Unsupported(reason)
    if str(args.get("--optimizer", "adam")) not in ("adam", "adamw"):
        raise Unsupported(f"optimizer {args.get('--optimizer')} is not modelled (Adam only)")
    layers = _int(args, "--num-layers") or _int(args, "--decoder-num-layers")
    hidden, heads = _int(args, "--hidden-size"), _int(args, "--num-attention-heads")
    seq = _int(args, "--seq-length") or _int(args, "--encoder-seq-length")
    micro = _int(args, "--micro-batch-size")
    missing = [n for n, v in (("--num-layers", layers), ("--hidden-size", hidden), ("--num-attention-heads", heads),
                              ("--seq-length", seq), ("--micro-batch-size", micro)) if not v]
    if missing:
        raise Unsupported(f"{', '.join(missing)} missing")
    assert layers and hidden and heads and seq and micro
    precision = "bf16" if _flag(args, "--bf16") else "fp16" if _flag(args, "--fp16") else "fp32"
    moe = None
    experts = _int(args, "--num-experts")
    if experts:
        freq = args.get("--moe-layer-freq")
        pattern = None
        if isinstance(freq, int) and freq > 1:
            pattern = tuple(1 if i % freq == 0 else 0 for i in range(layers))
        elif isinstance(freq, str) and "[" in freq:
            try:
                pattern = _expand_pattern(freq)
            except ValueError:
                raise Unsupported(f"--moe-layer-freq {freq!r} is not read") from None
        capacity = (_float(args, "--moe-expert-capacity-factor", 0.0)
                    if args.get("--moe-expert-capacity-factor") is not None else None)
        moe = MoE(experts=experts, top_k=_int(args, "--moe-router-topk", 2) or 2,
                  ffn=_int(args, "--moe-ffn-hidden-size"), shared_ffn=_int(args, "--moe-shared-expert-intermediate-size", 0) or 0,
                  capacity_factor=capacity, layer_pattern=pattern,
                  router_fp32=str(args.get("--moe-router-dtype", "")) == "fp32",
                  dispatcher=str(args.get("--moe-token-dispatcher-type") or "allgather"))
    mla = None
    if _flag(args, "--multi-latent-attention"):
        mla = MLA(kv_lora=_int(args, "--kv-lora-rank", 512) or 512, q_lora=_int(args, "--q-lora-rank"),
                  qk_head=_int(args, "--qk-head-dim", 128) or 128, qk_pos=_int(args, "--qk-pos-emb-head-dim", 64) or 64,
                  v_head=_int(args, "--v-head-dim", 128) or 128)
    recompute = str(args.get("--recompute-granularity") or "none")
    vp = _int(args, "--num-virtual-stages-per-pipeline-rank", 1) or 1
    if _int(args, "--num-layers-per-virtual-pipeline-stage"):
        pp = _int(args, "--pipeline-model-parallel-size", 1) or 1
        vp = max(layers // (pp * (_int(args, "--num-layers-per-virtual-pipeline-stage") or 1)), 1)
    grad_fp32 = None
    if _flag(args, "--grad-reduce-in-bf16"):
        grad_fp32 = False
    elif _flag(args, "--accumulate-allreduce-grads-in-fp32"):
        grad_fp32 = True
    backend = str(args.get("--attention-backend") or "auto")
    local = str(args.get("--transformer-impl") or "transformer_engine") == "local"
    config = TrainingConfig(
        layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=micro, vocab=megatron_vocab(args),
        gpus=gpus or 1, global_batch=_int(args, "--global-batch-size"),
        query_groups=_int(args, "--num-query-groups") if _flag(args, "--group-query-attention") else None,
        kv_channels=_int(args, "--kv-channels"), ffn=_int(args, "--ffn-hidden-size"), swiglu=_flag(args, "--swiglu"),
        normalization=str(args.get("--normalization") or "LayerNorm"), bias=not _flag(args, "--disable-bias-linear"),
        qk_layernorm=_flag(args, "--qk-layernorm"),
        position_embedding=str(args.get("--position-embedding-type") or
                               ("rope" if _flag(args, "--use-rotary-position-embeddings") else "learned_absolute")),
        max_position=_int(args, "--max-position-embeddings"), untied=_flag(args, "--untie-embeddings-and-output-weights"),
        vocab_divisor=_int(args, "--make-vocab-size-divisible-by", 128) or 128,
        tp=_int(args, "--tensor-model-parallel-size", 1) or 1, pp=_int(args, "--pipeline-model-parallel-size", 1) or 1,
        vp=vp, cp=_int(args, "--context-parallel-size", 1) or 1, ep=_int(args, "--expert-model-parallel-size", 1) or 1,
        etp=_int(args, "--expert-tensor-parallel-size"), sequence_parallel=_flag(args, "--sequence-parallel"),
        first_stage_layers=_int(args, "--decoder-first-pipeline-num-layers"),
        last_stage_layers=_int(args, "--decoder-last-pipeline-num-layers"),
        embedding_as_layer=_flag(args, "--account-for-embedding-in-pipeline-split"),
        loss_as_layer=_flag(args, "--account-for-loss-in-pipeline-split"),
        distributed_optimizer=_flag(args, "--use-distributed-optimizer"), precision=precision,
        fp8=bool(args.get("--fp8-format")), grad_fp32=grad_fp32,
        recompute=recompute, recompute_method=str(args.get("--recompute-method") or "uniform"),
        recompute_layers=_int(args, "--recompute-num-layers", 1) or 1,
        flash_attention=backend not in ("unfused", "local") and not local,
        softmax_fp32_copy=local and _flag(args, "--no-masked-softmax-fusion"),
        cross_entropy_fusion=_flag(args, "--cross-entropy-loss-fusion")
        and str(args.get("--cross-entropy-fusion-impl") or "native") == "native",
        optimizer_instances=_int(args, "--num-distributed-optimizer-instances", 1) or 1,
        vp_group=_int(args, "--microbatch-group-size-per-virtual-pipeline-stage"),
        hidden_dropout=_float(args, "--hidden-dropout", 0.1), attention_dropout=_float(args, "--attention-dropout", 0.1),
        moe=moe, mla=mla)
    return config


def _expand_pattern(text: str) -> tuple[int, ...]:
    """'([0]*3+[1]*9)' or '[1,0,1]' → the layer pattern (Megatron takes a Python list expression; only lists,
    integers, + and * are read here, nothing is evaluated)."""
    import ast

    def value(node: ast.AST) -> list[int] | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [int(value(item)) for item in node.elts]  # type: ignore[arg-type]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right  # type: ignore[operator]
        raise ValueError(text)
    result = value(ast.parse(text.strip(), mode="eval").body)
    if not isinstance(result, list):
        raise ValueError(text)
    return tuple(result)


def _read(path: Path) -> str:
    if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
        raise AnalyzerError(str(path), f"{path.stat().st_size} bytes: not a configuration file",
                            f"Give the model's config (under {MAX_CONFIG_BYTES} bytes).")
    return path.read_text()


def read_megatron_config(path: Path, gpus: int | None = None) -> TrainingConfig:
    """A model_config.yaml (`MODEL_ARGS:` mapping) or a YAML/JSON mapping of Megatron arguments."""
    import yaml
    try:
        document = yaml.safe_load(_read(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise AnalyzerError(str(path), f"cannot read the Megatron arguments: {str(error).splitlines()[0]}",
                            "Give a model_config.yaml with a MODEL_ARGS: mapping of --flag: value.") from None
    args = document.get("MODEL_ARGS", document) if isinstance(document, dict) else None
    if not isinstance(args, dict):
        raise AnalyzerError(str(path), "no MODEL_ARGS mapping of --flag: value",
                            "Give a model_config.yaml as Megatron-LM's functional tests keep them.")
    try:
        return from_megatron_args({str(k): v for k, v in args.items()}, gpus)
    except Unsupported as reason:
        raise AnalyzerError(str(path), f"cannot estimate this configuration: {reason}") from None


def read_hf_config(path: Path, seq: int, micro_batch: int, gpus: int | None = None) -> TrainingConfig:
    """A Hugging Face config.json (Llama, Mistral, Qwen, GPT-2, Mixtral shapes): the model's shape; the run's
    sequence, micro-batch and parallel layout come from the flags."""
    import json
    try:
        document = json.loads(_read(path))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise AnalyzerError(str(path), f"cannot read the Hugging Face config: {error}",
                            "Give the model's config.json.") from None
    if not isinstance(document, dict):
        raise AnalyzerError(str(path), "not a JSON object", "Give the model's config.json.")
    text = document.get("text_config")
    if isinstance(text, dict):
        document = {**document, **text}

    def get(*names: str) -> Any:
        return next((document[n] for n in names if isinstance(document.get(n), (int, float))), None)
    layers, hidden = get("num_hidden_layers", "n_layer"), get("hidden_size", "n_embd", "d_model")
    heads, vocab = get("num_attention_heads", "n_head"), get("vocab_size")
    if not (layers and hidden and heads and vocab):
        raise AnalyzerError(str(path), "no num_hidden_layers, hidden_size, num_attention_heads and vocab_size",
                            "Give a decoder's config.json (Llama, Mistral, Qwen, GPT-2 or Mixtral shape).")
    if layers > MAX_STAGES * 100:
        raise AnalyzerError(str(path), f"{layers} layers", f"At most {MAX_STAGES * 100} layers are estimated.")
    act = str(document.get("hidden_act") or document.get("activation_function") or "gelu")
    experts = get("num_local_experts", "num_experts", "n_routed_experts")
    expert_ffn = int(get("moe_intermediate_size", "intermediate_size") or 0) or None
    dense_first = int(get("first_k_dense_replace") or 0)      # DeepSeek: the first layers keep a dense MLP
    shared = int(get("shared_expert_intermediate_size") or 0) or int(get("n_shared_experts") or 0) * (expert_ffn or 0)
    moe = (MoE(experts=int(experts), top_k=int(get("num_experts_per_tok", "moe_topk") or 2), ffn=expert_ffn,
               shared_ffn=shared, layer_pattern=tuple(int(i >= dense_first) for i in range(int(layers)))
               if dense_first else None) if experts else None)
    mla = (MLA(kv_lora=int(get("kv_lora_rank") or 0), q_lora=int(get("q_lora_rank") or 0) or None,
               qk_head=int(get("qk_nope_head_dim") or 128), qk_pos=int(get("qk_rope_head_dim") or 64),
               v_head=int(get("v_head_dim") or 128)) if get("kv_lora_rank") else None)
    return TrainingConfig(
        layers=int(layers), hidden=int(hidden), heads=int(heads), seq=seq, micro_batch=micro_batch, vocab=int(vocab),
        gpus=gpus or 1, query_groups=int(get("num_key_value_heads") or heads),
        kv_channels=int(get("head_dim")) if get("head_dim") else None,
        ffn=int(get("intermediate_size", "n_inner") or 4 * hidden), swiglu=act in ("silu", "swiglu"),
        normalization="RMSNorm" if "rms_norm_eps" in document else "LayerNorm",
        bias=bool(document.get("attention_bias", "n_embd" in document)),
        position_embedding="rope" if "rope_theta" in document or "rotary_dim" in document else "learned_absolute",
        max_position=get("max_position_embeddings", "n_positions"),
        untied=not document.get("tie_word_embeddings", True), vocab_divisor=1,
        hidden_dropout=float(get("hidden_dropout", "resid_pdrop") or 0.0),
        attention_dropout=float(get("attention_dropout", "attn_pdrop") or 0.0), moe=moe, mla=mla)


def with_layout(config: TrainingConfig, **changes: Any) -> TrainingConfig:
    """The same job with other parallel sizes, recompute or precision (the flags that override a file)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})


__all__ = ["MLA", "MoE", "TrainingConfig", "Unsupported", "from_megatron_args", "read_megatron_config", "read_hf_config",
           "with_layout"]
