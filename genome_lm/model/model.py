"""The GLM-5.3-Flash text stack on megatron-core.

    tokens -> VocabParallelEmbedding -> N copies (mHC streams)
           -> layers: [mHC -> RMSNorm -> KDA or DSA -> mHC merge] [mHC -> RMSNorm -> MLP or MoE -> merge]
           -> mean over streams -> RMSNorm -> output layer (column-parallel over the vocabulary)

Each decoder layer is built from a megatron-core ``ModuleSpec`` (``specs.decoder_layer_spec``):
dense MLP layers are megatron-core's ``MLP``, MoE layers its ``MoELayer`` (sigmoid router with
expert bias, top-k scaling, shared expert, token dispatcher, expert parallel); the KDA and DSA
layers' parallel linears, like the MLPs', are the classes of megatron-core's spec provider
(local torch on CPU, Transformer Engine on GPU).
Process groups arrive explicitly as a ``ProcessGroupCollection``; nothing here reads
megatron-core's globals. Under context parallel the model takes and returns this CP rank's
zigzag part of each sequence (``genome_lm.engine.context_parallel.zigzag_split``); only the KDA
and DSA layers exchange tokens.

Sequence parallel (``ParallelSizes.sequence_parallel`` under tensor parallel): each TP rank keeps
only its 1/tp slice of the positions in the residual streams, so the mHC, the norms, the merges
and the MoE hold 1/tp of the tokens. The positions are padded at the end to a multiple of tp
(zero rows that never reach a token-mixing op and are cut before the output layer). The
attention and the dense MLP see the whole sequence: their input is all-gathered and their
(already all-reduced) output cut back to the rank's slice. The replicated parameters that see
only the rank's slice (mHC, norms) are marked ``sequence_parallel`` so that
the training step (``train.optim.allreduce_sequence_parallel_grads``) sums their gradients.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from genome_lm.engine import backend as engine_backend  # its current() read at each call (tests swap it)
from genome_lm.engine import quiet_megatron_import
from genome_lm.errors import GenomeLMError

from .common import BuildOptions, RMSNorm, megatron_config
from .config import SHARED, ModelConfig
from .dsa import IndexerLossMode
from .layer import DecoderLayer, gather_positions, scatter_positions  # noqa: F401  (DecoderLayer: callers)
from .specs import decoder_layer_spec

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from genome_lm.config import RunConfig
    from genome_lm.engine.parallel import ParallelSizes


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # [B, T, V] (vocabulary-parallel shard unless gathered)
    indexer_losses: list[torch.Tensor]  # one per DSA layer with its own indexer, when asked for


class GLM5Model(nn.Module):
    """GLM-5.3-Flash text model. ``forward(input_ids [B, T]) -> ModelOutput``."""

    def __init__(self, cfg: ModelConfig, pg: ProcessGroupCollection, sizes: ParallelSizes,
                 options: BuildOptions = BuildOptions(), layer_specs=None):
        """``layer_specs``: one megatron-core ``ModuleSpec`` per layer; default
        ``specs.decoder_layer_spec`` with the options' spec provider."""
        super().__init__()
        from megatron.core import tensor_parallel

        self.cfg, self.options, self.pg = cfg, options, pg
        self.share_embeddings_and_output_weights = False  # read by megatron-core's finalize_model_grads
        if pg.pp.size() > 1 and cfg.tie_word_embeddings:
            raise GenomeLMError("pipeline parallel with tied input and output embeddings is not supported")
        self.tf_config = tf_config = megatron_config(cfg, sizes, options)
        stage, stages = pg.pp.rank(), pg.pp.size()
        self.pre_process, self.post_process = stage == 0, stage == stages - 1
        self.layer_offset, count = pipeline_split(cfg, tf_config)[stage]
        self.global_layers = range(self.layer_offset, self.layer_offset + count)
        from megatron.core.transformer.spec_utils import build_module

        provider = options.spec_provider()
        if layer_specs is None:
            layer_specs = [decoder_layer_spec(cfg, i, provider) for i in range(cfg.num_hidden_layers)]
        if len(layer_specs) != cfg.num_hidden_layers:
            raise ValueError(f"{len(layer_specs)} layer specs for {cfg.num_hidden_layers} layers")
        if self.pre_process:
            self.embedding = tensor_parallel.VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, init_method=tf_config.init_method, config=tf_config, tp_group=pg.tp)
        self.layers = nn.ModuleList(build_module(layer_specs[i], cfg, i, tf_config, options, pg)
                                    for i in self.global_layers)
        if self.post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, options.dtype)
            self.output_layer = provider.column_parallel_linear()(
                cfg.hidden_size, cfg.vocab_size, config=tf_config, init_method=tf_config.init_method, bias=False,
                gather_output=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=pg.tp)
        self.sequence_parallel = bool(getattr(sizes, "sequence_parallel", False)) and pg.tp.size() > 1
        if self.sequence_parallel:  # replicated, but each rank's gradient covers its slice only
            sliced = ([self.final_norm] if self.post_process else []) + [
                m for layer in self.layers for m in
                (layer.attn_hc, layer.ffn_hc, layer.input_layernorm, layer.post_attention_layernorm)]
            for module in sliced:
                for p in module.parameters():
                    p.sequence_parallel = True

    def global_name(self, name: str) -> str:
        """A parameter's or module's name with the layer numbered as in the whole model (under
        pipeline parallel a stage's ``layers.0`` is the model's ``layers.<offset>``)."""
        if self.layer_offset and name.startswith("layers."):
            i, dot, rest = name[len("layers."):].partition(".")
            return f"layers.{int(i) + self.layer_offset}{dot}{rest}"
        return name

    def stream_shape(self, batch: int, positions: int) -> tuple[int, int, int, int]:
        """Shape [S, B, N, D] of the mHC streams one pipeline stage passes to the next for a
        micro-batch of ``batch`` sequences of ``positions`` local positions (this rank's slice
        of them under sequence parallel)."""
        tp = self.pg.tp.size()
        rows = -(-positions // tp) if self.sequence_parallel else positions
        return rows, batch, self.cfg.hc_mult, self.cfg.hidden_size

    def hidden(self, input_ids: torch.Tensor | None, indexer_loss: IndexerLossMode = "off",
               indexer_tokens: int | None = None, caches: list | None = None, *,
               streams: torch.Tensor | None = None, positions: int | None = None):
        """Final hidden states [S, B, D] and the indexer losses (over the first ``indexer_tokens``
        positions of each whole sequence when given: the rest is padding). ``caches``: one per
        layer, for chunked prefill (``genome_lm.model.prefill``).

        Under pipeline parallel this is one stage: a stage after the first takes the previous
        stage's ``streams`` (``stream_shape``) instead of ``input_ids``, with the number of
        ``positions`` they cover, and a stage before the last returns its streams instead of the
        final hidden states; each stage returns the indexer losses of its own DSA layers."""
        if self.pre_process:
            if self.pg.cp.size() > 1 and input_ids.shape[1] % 2:
                raise ValueError(f"under context parallel each rank holds two equal zigzag chunks; got "
                                 f"{input_ids.shape[1]} local tokens (the sequence length must be divisible by "
                                 "2 * context parallel)")
            x = self.embedding(input_ids).transpose(0, 1)  # [S, B, D]
            positions = x.shape[0]
            sp_len = positions if self.sequence_parallel and caches is None else None
            if sp_len is not None:
                x = scatter_positions(x, self.pg.tp)
            streams = x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        else:
            if streams is None or positions is None:
                raise ValueError("a pipeline stage after the first takes the previous stage's streams and their "
                                 "number of positions")
            sp_len = positions if self.sequence_parallel and caches is None else None
        idx, losses = None, []
        for i, layer in enumerate(self.layers):
            streams, idx, loss = layer(streams, idx, indexer_loss, indexer_tokens,
                                       None if caches is None else caches[i],
                                       sp_len=sp_len)
            if loss is not None:
                losses.append(loss)
        if not self.post_process:
            return streams, losses
        h = self.final_norm(streams.mean(dim=2))
        return (h if sp_len is None else gather_positions(h, sp_len, self.pg.tp)), losses

    def forward(self, input_ids: torch.Tensor, *, gather_logits: bool = True,
                indexer_loss: IndexerLossMode = "off", indexer_tokens: int | None = None,
                caches: list | None = None) -> ModelOutput:
        if self.pg.pp.size() > 1:
            raise ValueError("under pipeline parallel run each stage with hidden() (genome_lm.train.pipeline)")
        h, losses = self.hidden(input_ids, indexer_loss, indexer_tokens, caches)
        logits = self.output_layer(h)[0]  # [S, B, V / tp]
        if gather_logits and self.pg.tp.size() > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits, group=self.pg.tp)
        return ModelOutput(logits.transpose(0, 1), losses)


def pipeline_split(cfg: ModelConfig, tf_config) -> list[tuple[int, int]]:
    """(first layer, number of layers) of every pipeline stage, checked: the stages cover the
    layers in order, each has at least one, and none starts at a DSA layer that reuses the
    previous layer's token selection (it would have to come from the stage before). Every rank
    checks every stage, so a bad split is an error on all ranks rather than a hang."""
    stages = tf_config.pipeline_model_parallel_size
    splits = [pipeline_layers(tf_config, s) for s in range(stages)]
    if [o for o, _ in splits] != [sum(n for _, n in splits[:s]) for s in range(stages)] or \
            sum(n for _, n in splits) != cfg.num_hidden_layers or min(n for _, n in splits) < 1:
        raise GenomeLMError(f"pipeline parallel {stages} does not split the {cfg.num_hidden_layers} layers into "
                         f"stages (first layer, count per stage: {splits})")
    for s, (offset, _) in enumerate(splits):
        if offset > 0 and cfg.indexer_types[offset] == SHARED:
            raise GenomeLMError(f"pipeline stage {s} would start at layer {offset}, a DSA layer that reuses the "
                                "previous layer's token selection; choose a pipeline size that does not split them")
    return splits


def pipeline_layers(tf_config, stage: int) -> tuple[int, int]:
    """(first layer, number of layers) of pipeline ``stage``, by megatron-core's rule (an even
    split, or ``num_layers_in_first/last_pipeline_stage`` when the config sets them)."""
    if tf_config.pipeline_model_parallel_size == 1:
        return 0, tf_config.num_layers
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        return (get_transformer_layer_offset(tf_config, pp_rank=stage),
                get_num_layers_to_build(tf_config, pp_rank=stage))
    except AssertionError as exc:  # megatron-core asserts that the stages split the layers evenly
        raise GenomeLMError(f"pipeline parallel {tf_config.pipeline_model_parallel_size} cannot split the "
                         f"{tf_config.num_layers} layers: {exc}") from None


def build_model(cfg: ModelConfig, pg: ProcessGroupCollection, sizes: ParallelSizes, *,
                transformer_impl: str = "local", kernel_backend: str = "auto",
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                moe_aux_loss_coeff: float = 0.0, moe_aux_loss: str = "seq_aux_loss",
                absorbed_mla: bool | None = None, compiled: bool = False) -> GLM5Model:
    """Build the model for the process groups ``pg`` (from ``engine.parallel.parallel_context``);
    the MoE auxiliary loss options and ``compiled`` are ``BuildOptions``'. ``kernel_backend``
    "auto" is what the backend profile says for the device (``profile.kernel_backend``); the name
    is resolved here, once, and the layers read the result from ``BuildOptions``.
    ``absorbed_mla`` None: absorbed with the GPU kernel backends (where it runs on tensor cores),
    per-head on the CPU paths."""
    from genome_lm_kernels import resolve_backend

    profile = engine_backend.current()
    device = torch.device(device or profile.device)
    if kernel_backend == "auto" and device.type == profile.device:
        kernel_backend = profile.kernel_backend
    backend = resolve_backend(kernel_backend, device)
    if compiled and device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            get_cpp_compiler()  # inductor's own search (CXX, else g++): the compiler compiling will use
        except InvalidCxxCompiler:
            # a speed option only: the run goes on, eager, rather than failing at its first step
            logging.getLogger(__name__).warning(
                "model.compile: no C++ compiler found for torch.compile on a CPU (CXX, else g++); "
                "running without it (the same results, slower)")
            compiled = False
    options = BuildOptions(transformer_impl=transformer_impl, dtype=dtype, kernel_backend=backend,
                           moe_aux_loss_coeff=moe_aux_loss_coeff, moe_aux_loss=moe_aux_loss,
                           absorbed_mla=backend.gpu if absorbed_mla is None else absorbed_mla,
                           compiled=compiled, split_dsa_selection=getattr(sizes, "split_dsa_selection", True),
                           shared_expert_overlap=getattr(sizes, "moe_shared_expert_overlap", False))
    if options.shared_expert_overlap and profile.moe_dispatcher != "alltoall":
        raise GenomeLMError(f"parallel.moe_shared_expert_overlap needs megatron-core's all-to-all token dispatcher "
                            f"(CUDA streams, the GPU backend); this run's {profile.name} backend uses the "
                            f"{profile.moe_dispatcher} dispatcher: set it to false")
    if not profile.cpu_initialization:
        # megatron-core initialises its parallel layers on the GPU from the CUDA RNG tracker's
        # states (data-, tensor- and expert-parallel), which must be seeded first; the callers'
        # torch.manual_seed picks the seed
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(torch.initial_seed())
    return GLM5Model(cfg, pg, sizes, options).to(device)


def pipeline_stages(cfg: ModelConfig, run: RunConfig) -> list[tuple[int, int]]:
    """(first layer, number of layers) per pipeline stage of ``run`` (a RunConfig), as the trainer
    splits them (``pipeline_split``: megatron-core's rule, checked); no process group needed."""
    p = run.parallel
    if p.pp == 1:
        return [(0, cfg.num_hidden_layers)]
    from genome_lm.engine.parallel import ParallelSizes

    with quiet_megatron_import():
        tf_config = megatron_config(cfg, ParallelSizes(tp=p.tp, cp=p.cp, pp=p.pp), BuildOptions())
    return pipeline_split(cfg, tf_config)
