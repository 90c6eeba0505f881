"""Every diagnostic code with a one-paragraph explanation (`meshc explain-error CODE`), and a constant
per code that every emission site uses (`from meshllm_dsl.codes import E0301`): a mistyped code is an
ImportError when its module is imported, and a code without an explanation fails this module's import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Final

CODES: dict[str, tuple[str, str]] = {
    "E0101": ("unexpected token", "The parser met a token that cannot appear at this point of the grammar "
              "(grammar/mesh.lark). The help line lists what the parser would have accepted there. Only the first "
              "syntax error of a file is reported, because everything after it would be guesswork."),
    "E0102": ("unexpected character", "A character that starts no token of the language, such as `@` or `$`. "
              "Names are ASCII identifiers, numbers are decimal, comments start with `#`."),
    "E0103": ("include not found, refused or cyclic", "An `include \"FILE\"` names a file that exists neither "
              "next to the including file, nor in a directory given with `-I DIR`, nor in the shipped standard "
              "library; or it is refused (an absolute path, or not a `.mesh` file: includes never read anything "
              "but specs); or it includes a file that is already being included (a cycle). Shared declarations "
              "belong in a third file that both include."),
    "E0104": ("unreadable spec file", "A spec (or a file it includes) is not a regular file, is larger than the "
              "size cap (4 MiB), is binary, or is not valid UTF-8 text. Specs are UTF-8 text; line endings may be "
              "\\n, \\r\\n or \\r and a leading byte-order mark is ignored. A file that is not text is never "
              "echoed in a diagnostic."),
    "E0201": ("duplicate name", "Two declarations of the same kind share a name: two meshes, models, plans or "
              "families, two axes of one mesh, two layers of one block, or one setting given twice. Names must be "
              "unique so that rules and references are unambiguous."),
    "E0202": ("unknown name", "A reference names something that is not declared: a mesh, model, family, "
              "mesh axis, dim, layer, primitive or device profile. The help line suggests the closest known name."),
    "E0203": ("unknown setting or argument", "A setting, keyword argument or option value that the construct "
              "does not have, such as a misspelled mesh setting, an activation that does not exist or a family "
              "parameter the family does not declare."),
    "E0204": ("invalid identifier", "Every name in a spec can reach generated Python code, so names must be plain "
              "identifiers: not Python keywords, not dunder names, and (for layers and axes) not attributes that "
              "torch.nn.Module or the generated module already define, such as `forward`. This is what makes it "
              "impossible for a spec to inject code into generated files."),
    "E0205": ("missing parameter", "A model does not give a value for a family parameter that has no default, "
              "or a layer primitive is called without a required argument."),
    "E0301": ("not divisible", "A sharded tensor dim must split into whole units over the product of its mesh "
              "axes: heads and kv_heads for attention projections, ffn for the MLP, vocab for embeddings and the "
              "head. Otherwise some ranks would hold a fraction of a head (or of the vocabulary) and silently "
              "compute something else. The help line lists the axis sizes that divide every dim split over that "
              "axis."),
    "E0302": ("inexact division", "`/` in a dim expression must divide exactly (dims are integers), e.g. "
              "`head_dim = hidden / heads` needs heads to divide hidden. Also raised for division by zero and for "
              "grouped-query attention whose heads are not a multiple of kv_heads."),
    "E0303": ("size must be positive", "Mesh axis sizes, dims, repeat counts and plan sizes must be positive "
              "integers."),
    "E0304": ("wrong kind of value", "A value of the wrong type: a number where a name is needed, a float where a "
              "dim must be an integer, a non-boolean for a flag, or a tie between layers of different shapes; a list "
              "where one value goes, a list item that is not a number, or a list of the wrong length (longrope's "
              "factors: head_dim / 2 each)."),
    "E0305": ("batch does not split", "The global batch is divided over the batch (data-parallel) axes and then "
              "into microbatches, so it must be a multiple of (data axes size) x microbatches."),
    "E0306": ("device count mismatch", "`devices = N` must equal the product of the axis sizes, and `hosts` must "
              "divide the device count so every host has the same number of devices."),
    "E0307": ("value out of range", "Every number in a spec has a range, checked where it is written: integers "
              "(dims, sizes, counts) are at most 2**40 with at most 18 digits, a mesh has at most 2**17 (131,072) devices "
              "and a repeat at most 100,000 blocks; floats are finite and each setting has its own bounds (a "
              "learning rate or eps above 0, Adam betas in [0, 1), rope_theta above 0). A value outside its range "
              "would otherwise reach generated code (as `inf` or `nan`) or make a later tool run out of time or "
              "memory."),
    "E0308": ("layer shapes do not chain", "A model is a chain: the token embedding first, then layers that "
              "keep the residual width (norms, attention, MLP), then the head. Every layer's input width must be "
              "the width of what feeds it, a norm is not placed after the head, the head produces one logit per "
              "vocabulary entry, and a block alternates norm and sublayer (x = x + sublayer(norm(x))). A model "
              "that breaks the chain would be accepted here and fail to compile or run."),
    "E0309": ("not supported yet", "The language admits this construct or setting, but the runtime does not "
              "implement it end to end yet (checker, planner, generated code, runtime and `meshc verify` all "
              "agree only on what is implemented). Rather than budget or accept something that would then be "
              "silently ignored, meshc refuses it; the help line names what is supported."),
    "E0310": ("sequence longer than the positions", "A model with learned positions (`positional(N, ...)`, "
              "GPT-2's `positions`) has embeddings for N positions only: a plan whose `seq` exceeds N would index "
              "past the table at run time."),
    "E0311": ("expression too deeply nested", "An expression nests more than 100 operators (`1 + 1 + ...`, "
              "`- - 1`). Spec expressions are small arithmetic over dims; compute the value or name its parts."),
    "E0312": ("more devices per host than the device holds", "`hosts = H` spreads the mesh's devices evenly over H "
              "hosts, so each host holds devices / H of them; the device profile's `per_host` (8 for the GPU profiles, "
              "4 for `l40s` and `a10g`, or the `per_host` of a declared `device`) is how many one host has. More per "
              "host than that cannot run (a SLURM job would ask every node for GPUs it does not have), and the "
              "planner would price collectives between them as in-host. Raise `hosts`, or declare a device profile "
              "whose hosts hold more."),
    "E0401": ("axis used twice for one tensor", "A tensor dim can be split over a mesh axis once; listing an axis "
              "twice in one rule, or a layout that would split both dims of one weight over axes, is rejected."),
    "E0402": ("layout mismatch at a layer boundary", "Activations carry a layout (Replicate, Shard over axes, "
              "Partial over axes). A column-parallel layer needs a replicated input and yields a sharded output; "
              "a row-parallel layer consumes that sharded output. A column layer feeding a column layer, a "
              "replicated layer fed a sharded activation, attention fed q / k / v laid out differently, or a "
              "sharded activation reaching the residual stream would each need an implicit gather; meshc makes "
              "them errors and names the rule that fixes them."),
    "E0403": ("partial sum reaches a non-linearity", "A row-parallel layer's output is a partial sum: each rank "
              "holds a term, and the true activation is their sum. Applying a non-linearity (softmax in "
              "attention, an activation, a norm) to the terms and summing afterwards is not the same as applying "
              "it to the sum, so the result would be silently wrong. Row layers belong at the end of a sublayer, "
              "where the sum is taken before the residual add."),
    "E0404": ("loss input layout", "The loss must match the layout of the logits: full logits take "
              "`cross_entropy`, logits sharded over the vocabulary take `vocab_parallel(AXIS)` (which never "
              "gathers them), and partial-sum logits from a row-parallel head are never a valid loss input. "
              "This is the mistake that makes other tools compute a wrong loss silently."),
    "E0405": ("rule does not apply to this layer", "A rule used on a layer kind it cannot shard: norms and "
              "positional embeddings are only replicated, token embeddings are vocab-parallel or replicated, "
              "`vocab_parallel` is for embeddings (use `column` for a head), `expert(AXES)` for moe layers."),
    "E0406": ("unknown rule", "The sharding rules are `column(AXES)`, `row(AXES)`, `vocab_parallel(AXES)`, "
              "`replicate` and `expert(AXES)` (a moe layer's experts); losses are `cross_entropy` and "
              "`vocab_parallel(AXES)`."),
    "E0407": ("axis has two roles", "A mesh axis is the pipeline axis, a batch (data-parallel) axis, or an axis "
              "parameters are sharded over; not two of these. ZeRO shards optimizer state over the batch "
              "axes, or over some of them and replicates over the rest (HSDP)."),
    "E0408": ("tied weights placed differently", "Layers that share one weight (a head tied to the embedding) "
              "must place it the same way: `vocab_parallel(T)` for the embedding with `column(T)` for the head "
              "split the same vocabulary rows."),
    "E0409": ("nothing to recompute", "`recompute = blocks` wraps every block of the model's repeated stack in "
              "activation checkpointing (torch.utils.checkpoint, non-reentrant) and `recompute = attention` only "
              "the attention core inside each block. A model without a `repeat` (or whose blocks hold no "
              "attention, for `attention`) has nothing the setting would apply to, so it is refused rather than "
              "silently ignored; so is `every N` with N above the number of blocks."),
    "E0410": ("sequence parallelism does not fit the plan", "`layout { seq -> tensor }` asks for Megatron-LM "
              "sequence parallelism over the tensor axes: the norms and the residual stream between sublayers "
              "hold [b, s / t, hidden], each attention / mlp gathers the sequence in front of its column layers "
              "and reduce-scatters it after its row layer. So every sublayer of the blocks must be "
              "tensor-parallel (column -> row) over exactly those axes, and the model needs such blocks; a plan "
              "without tensor parallelism, or one whose blocks split over another axis, is refused. `seq` must "
              "also divide by the axes' size (E0301)."),
    "E0411": ("context parallelism does not fit the plan", "`layout { seq -> AXIS }` over an axis that splits "
              "no weight is context parallelism: every rank of AXIS holds two of the 2 x |AXIS| equal chunks of "
              "each sequence (chunks i and 2 |AXIS| - 1 - i, so the causal work is balanced) through the whole "
              "model, and attention all-gathers keys and values over AXIS. AXIS must be an axis of its own (not "
              "the pipeline or a batch axis) and `seq` must divide by 2 x |AXIS| (E0301). One `seq` entry may "
              "name both kinds of axes (`seq -> tensor * cp`): sequence parallelism over the ones that split "
              "weights (E0410) inside context parallelism over the rest, with `seq` dividing into the chunks "
              "and each chunk pair over the tensor axes. What does not compose with it yet "
              "(a tensor-parallel export) is refused here rather than run wrong."),
    "E0412": ("expert parallelism does not fit the plan", "`layout { experts -> D }` splits every moe layer's "
              "experts over the mesh axes D, as DeepSpeed-MoE, Megatron-Core and torchtitan do: each rank holds "
              "experts / |D| of them and tokens travel to their experts' ranks and back by all-to-all. The "
              "tokens differ along batch and context axes, whose tokens travel; along a tensor axis (one that "
              "splits other weights, not by sequence parallelism) they are the same, so each of its ranks routes "
              "an equal share of a microbatch's tokens (which must split evenly) to whole experts (etp = 1: "
              "their ffn not split too) and the outputs are all-gathered. D is any product of them, as "
              "torchtitan folds EP over dp_shard x cp x tp; the model needs moe layers, and `experts` must divide by D's size (E0301). What the "
              "runtime does not yet do with expert parallelism is refused here too."),
    "E0501": ("parameter not placed", "A plan that has any sharding rule must place every shardable parameter "
              "exactly once, by a `shard` rule or a layout entry; replicate it explicitly with `replicate` if "
              "that is what you mean. Silently replicating a forgotten layer is how plans run out of memory."),
    "E0502": ("rule matches nothing", "A `shard` pattern or layout entry that matches no parameter. Other tools "
              "skip such keys silently, leaving the layer replicated; meshc rejects them and lists the layer "
              "paths that exist."),
    "E0503": ("overlapping rules", "Two rules match the same parameter (for the same blocks). Exactly one rule "
              "must place each parameter, so the plan reads the same whatever the rule order."),
    "E0601": ("layer in no stage", "The stage map must cover every top-level layer and every block of the "
              "repeat exactly once."),
    "E0602": ("layer in two stages", "A layer or a block appears in more than one stage."),
    "E0603": ("stages out of order", "Stages are numbered 0, 1, 2, ... and hold the model's layers contiguously "
              "and in order, because activations flow from stage i to stage i + 1."),
    "E0604": ("wrong number of stages", "The number of stages must equal the pipeline axis size times the "
              "virtual stages per rank."),
    "E0605": ("empty stage", "Every stage must hold at least one layer."),
    "E0606": ("too few microbatches", "1F1B needs at least as many microbatches as pipeline stages (torch's "
              "schedule otherwise cannot fill the pipeline and the job hangs); interleaved 1F1B also needs "
              "microbatches divisible by the pipeline size; DualPipeV at least as many microbatches as stages "
              "(2 per rank); interleaved zero bubble whole rounds (m a multiple of max(1, m // p))."),
    "E0607": ("schedule invalid", "Schedules are `gpipe`, `1f1b`, `interleaved_1f1b`, `looped_bfs`, "
              "`interleaved_zb`, `zbv` and `dualpipev` (torch.distributed.pipelining's classes). `gpipe` and `1f1b` "
              "run one stage per rank; `interleaved_1f1b` needs `virtual N` stages per rank; `zbv` and `dualpipev` "
              "exactly `virtual 2`, placed in a V (rank r holds stages r and 2p - 1 - r); the others any number, "
              "placed in a loop. A written `placement` must be the schedule's."),
    "E0608": ("cannot balance stages", "`balanced` splits the repeated blocks over the stages by compute (the "
              "layers before and after them weigh their flops), and every stage that holds no other layer needs "
              "at least one block: the model needs a repeat with enough blocks; otherwise list the stages."),
    "E0609": ("bad block range", "A stage's block range `blocks[a:b]` must satisfy 0 <= a < b <= count, and "
              "only repeats can be sliced."),
    "E0313": ("a matmul recipe this dtype or device cannot run", "`precision { matmul = R }` (or `precision PATH "
              "matmul = R`) asks torchao to train linear layers in float8: `fp8_tensorwise`, `fp8_rowwise` or `mxfp8`. "
              "The recipes cast bf16 (or fp16) activations and weights, so the compute dtype (`params`) must be one of "
              "them; fp32 master weights stay as they are (`precision { params = bf16, master = fp32, matmul = ... }`). "
              "The float8 recipes need float8 tensor cores (Hopper, Ada, Blackwell, MI300: a profile with "
              "`fp8_tflops`), `mxfp8` needs MX tensor cores (Blackwell: `mx_tflops`). On CPU ranks torchao emulates "
              "the float8 matmuls, which proves the numerics but is slower than the params dtype."),
    "W0701": ("stage imbalance", "One pipeline stage holds more than 1.25x the mean parameter count. The "
              "pipeline advances at the pace of its slowest stage, so the others idle."),
    "W0702": ("tensor axis spans hosts", "Tensor-parallel collectives run in every layer; across the network "
              "they are an order of magnitude slower than within a host. Put the tensor axis last in `axes` (it "
              "then varies fastest) and keep it within a host."),
    "W0703": ("fewer microbatches than stages", "With GPipe and fewer microbatches than stages, the bubble "
              "(p - 1) / (m + p - 1) is more than half of the step."),
    "W0704": ("unused mesh axis", "Every rank along an unused axis does identical work: the devices are "
              "wasted. Use it for data parallelism, sharding or the pipeline, or shrink the mesh."),
    "W0705": ("sharded over an axis of size 1", "A rule splits a tensor over mesh axes whose product is 1: "
              "nothing is split, so the rule only adds collectives that move nothing. Use `replicate`, or give "
              "the axis a size above 1."),
    "W0706": ("over-sharding", "A rule leaves each device fewer than 128 columns of a dim of at least 1,024: "
              "the per-layer all-reduces then cost more than the matrix products they split. Use a smaller "
              "tensor axis and give the devices to data parallelism (`meshc plan` estimates the times)."),
    "W0707": ("tensor axis larger than a host", "The mesh declares no `hosts`, and a sharding axis is larger than "
              "the device profile's devices per host (`per_host`): it cannot stay within one host, so its "
              "collectives cross the network every layer (the planner assumes the fewest hosts that hold the mesh, "
              "W0708). Declare `hosts` and keep the tensor axis within a host."),
    "W0708": ("hosts omitted for a mesh larger than a host", "A mesh without `hosts` has more devices than one "
              "host of its device profile holds (`per_host`). It cannot be one host, so `meshc plan` and "
              "`meshc compile --slurm` take it as the fewest hosts that hold it evenly (the warning names how many): "
              "collectives between those hosts are priced at the network's bandwidth, not the in-host link's, and "
              "the SLURM script asks for that many nodes. Declare `hosts` to say what the cluster really is."),
    "W0709": ("layer kept out of float8", "A linear layer that `matmul = R` would convert stays in the params "
              "dtype because a dim of its local weight (after tensor parallelism splits it) is not a multiple of 16: "
              "torchao's float8 kernels (torch._scaled_mm) need 16-byte-aligned operands. The plan still trains; "
              "the planner prices that layer in the params dtype. Split the layer over fewer ranks, or keep it in "
              "the params dtype explicitly with `precision PATH matmul = bf16`, which silences this warning."),
    "W0710": ("float8 without compiled blocks", "A plan trains matmuls in float8 on a GPU without `compile = "
              "blocks`. torchao then casts each operand to float8 and computes its scale in separate eager kernels "
              "that read and write the whole tensor, which can cost more than the faster matmul saves: measured on "
              "one H200 (bench/float8.py), eager fp8_tensorwise trained at 0.48x the tokens/s of bf16 and compiled "
              "fp8_tensorwise at 1.38x. torch.compile fuses the casts into the kernels around them; torchtitan "
              "reports float8 only with compile. The planner prices the casts' memory traffic, not their launches."),
    "W0801": ("plan does not fit in device memory", "`meshc plan` estimates the peak memory of every pipeline rank: "
              "weights, gradients and optimizer states (16 bytes per parameter for mixed-precision AdamW, divided "
              "per the ZeRO stage), plus the activations of the microbatches the schedule keeps in flight. The "
              "peak exceeds the device profile's memory, so the job would run out of memory at its first step. "
              "The note lists the parts; the help names the cheapest fix."),
    "W0802": ("over-sharding", "A sharding axis whose last doubling costs more collective time per step than "
              "the compute it removes: each device holds too few parameters for the all-reduces every "
              "tensor-parallel layer issues. Halve the axis and give the devices to data parallelism if the plan "
              "still fits in memory."),
    "W0803": ("communication-dominated step", "The estimated communication per step (tensor all-reduces, "
              "pipeline sends, data-parallel gradient reduction) exceeds the compute. Devices wait on links "
              "most of the time; larger microbatches or less tensor parallelism raise compute per byte moved."),
    "W0804": ("tensor axis over the inter-host link", "A tensor-parallel axis whose process groups span "
              "hosts: its all-reduces, issued in every layer, run over the network at a fraction of NVLink "
              "bandwidth. The warning states the time per step over the network and within a host."),
    "W0805": ("large pipeline bubble", "The pipeline bubble (p - 1) / (m + p - 1) (divided by v when "
              "interleaved) is above 20% of the step: devices idle while the pipeline fills and drains. Raise "
              "the microbatch count or interleave virtual stages."),
    "W0806": ("stage memory imbalance", "One pipeline rank needs more than 1.25x the memory of another. The "
              "mesh must be sized for the largest, so the others waste memory. 1F1B keeps more microbatches of "
              "activations on early stages: give them fewer blocks."),
    "W0807": ("expert load skew", "With `skew = F` in a plan, the planner gives each moe layer's busiest expert a "
              "share F of the layer's routed tokens (the rest shared evenly) and plans every expert-parallel rank "
              "under it: the rank holding the busiest expert saves more activations and computes longer, the others "
              "wait for it at each layer, and every all-to-all lasts as long as its larger share of rows. Warned when that rank no longer fits in device memory, or the others wait "
              "more than 10% of the step; the message says by how much. A capacity factor (`capacity` on the model) "
              "bounds an expert's tokens, the load-balancing loss (`aux_loss_coef`) evens them out; `meshc run "
              "--profile` measures the busiest share of a real run."),
    "W0808": ("data ranks' attention skew", "`meshc plan --data SOURCE` packs the data's first steps in the seeded "
              "order and, under `pack = documents`, prices each row's attention by its documents (the sum of their "
              "squared lengths, not seq squared). Rows of one long document cost more than rows of many short ones, "
              "so one data rank can hold more attention work than the others, which wait for it every step. Warned "
              "when the busiest rank's work passes the average by more than 10% over those steps; the message says by "
              "how much and what it costs per step. `meshc run --balance` repacks each step's documents by length "
              "so the data ranks' work evens out (the same documents each step); `meshc data-stats --plan FILE "
              "--balance` shows what it reaches."),
    "W0809": ("context ranks' attention skew", "With context parallelism each device computes, of its data "
              "rank's rows, the queries its context rank holds. Under `pack = documents` a query sees only its own "
              "document's earlier tokens, so head-tail (chunks i and 2n - 1 - i of a row), which evens a causal row, "
              "can leave one context rank the late queries of a long document. `meshc plan --data SOURCE` splits the "
              "measured rows as the runtime does under each `context_balance` (runtime/parallel/context_layout.py) and "
              "warns when the split adds more than 10% to the busiest data rank's work; the message says by how much "
              "and what it costs per step, the help names the balance that measured best on the same rows "
              "(per_document: head-tail within every document; ptrr: blocks dealt by their work)."),
    "E1201": ("export: pipeline", "`meshc export` writes what torch's parallelize_module / fully_shard or a "
              "transformers tp_plan apply to one whole model; neither splits a model into pipeline stages "
              "(torch.distributed.pipelining does, outside them). Export a plan without `stages`. `--to torchtitan` "
              "does write a pipeline, with torchtitan's schedules and an even number of blocks per stage: "
              "stages of different sizes are refused there. `--to megatron` writes stages of any sizes (the layout "
              "string) but only Megatron's schedules (1f1b; interleaved_1f1b with virtual stages), stages in "
              "round-robin order, the embedding first and the head last."),
    "E1202": ("export: ZeRO 1", "fully_shard (FSDP2) shards gradients with the optimizer states: ZeRO 2 is "
              "reshard_after_forward=False, ZeRO 3 reshard_after_forward=True. It has no mode that shards only "
              "the optimizer states, so a `zero 1` plan is not exported; use `zero 2` or `zero 3` (torchtitan: "
              "fsdp_reshard_after_forward never / always)."),
    "E1203": ("export: sequence parallelism", "`layout { seq -> AXIS }` keeps activations Shard(seq) between "
              "sublayers. A transformers model computes its positions and causal mask from the local shape of its "
              "activations, which that changes, and a tp_plan's column styles take replicated inputs only, so "
              "`meshc export` does not write it; nor context parallelism (`seq -> AXIS` over an axis that splits no "
              "weight: every sequence split over AXIS). Drop `seq -> ...` to export the tensor-parallel plan. "
              "`--to torchtitan` writes both, but only sequence parallelism over the tensor axis and context "
              "parallelism whose axes ZeRO 2 / 3 also shards over (torchtitan's FSDP mesh is dp_shard x cp)."),
    "E1204": ("export: no transformers module", "The model must have the module layout of a transformers "
              "class export is proven for (the `llama` family: Llama, Mistral, Qwen2, Qwen3 and, with `--weights` "
              "naming a Phi-3 checkpoint, Phi-3; `olmo2`; `gemma2` / `gemma3`; `gpt2`: GPT2LMHeadModel; the "
              "mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4.5, GPT-OSS), a "
              "`--weights` checkpoint must be of the model exported, and a sharded layer must be an nn.Linear or "
              "nn.Embedding there: GPT-2's projections are Conv1D, which neither torch's parallel styles nor a "
              "tp_plan shard. `--to torchtitan` builds torchtitan's llama3 (a `llama` family model without biases, "
              "tied embeddings, a window, q / k norms, another norm_eps, head_dim or rope) or qwen3 (a llama with "
              "per-head q / k norms, eps 1e-6, no rope scaling; or the `qwen3_moe` family without a capacity "
              "factor, router losses or unrenormalised top-k) or deepseek_v3 (a model of DeepSeek-V3's build with "
              "sigmoid routing, shared experts, no `balance_rate`: torchtitan centres its bias update, and YaRN "
              "`rope_mscale` equal to `rope_mscale_all_dim`: torchtitan's rope is a pure rotation). `--to hf-ep-plan` "
              "takes a model with routed experts of a class its expert parallelism is proven for (Mixtral, "
              "Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GLM-4.5, GPT-OSS). `--to megatron` takes what Megatron's GPT model's switches say: the `llama` "
              "(q / k / v biases and head q / k norms included), `gpt2`, `mixtral`, `qwen2_moe` and `qwen3_moe` "
              "families (no capacity factor, no `aux_loss_coef`: Megatron's load-balancing loss is per layer), and "
              "models of DeepSeek-V3's build (`deepseek_v3`, `glm4_moe`: embed, dense blocks, moe blocks, norm, "
              "head) whose YaRN uses 4096 original positions and betas 32 / 1 (Megatron-LM has no flag for them) "
              "and whose groups are scored by their top 2 experts (top_k twice topk_groups, as Megatron scores a "
              "group by its top top_k / topk_groups)."),
    "E1205": ("export: layout the target lacks", "Each sharded layer becomes one parallel style over one mesh "
              "dimension: column -> ColwiseParallel / `colwise`, row -> RowwiseParallel / `rowwise`, "
              "vocab_parallel embedding -> RowwiseParallel(input_layouts=Replicate()) / `embedding_rowwise`. A "
              "layer split over several axes at once, a rule no style matches, or (for a tp_plan, which has one "
              "tensor mesh) layers sharded over different axes cannot be exported. Where transformers stores a "
              "sublayer's projections fused (Phi-3's qkv_proj, gate_up_proj) or normalises the whole projection "
              "(OLMo 2's q / k norms), the export gathers the column layers' output (`colwise_gather_output`) and "
              "splits the row layer's input (`rowwise_split_input`), as transformers' own plans for those classes do. "
              "A mixture-of-experts model's routers stay whole; its routed experts split by ffn are a tp_plan's moe "
              "styles on transformers' stacked experts module (`packed_colwise`, `rowwise`, `moe_tp_experts`), "
              "not GPT-OSS's (gate and up interleaved) and not DTensor's. DTensor has no style for DeepSeek-V3's "
              "latent rotary key (`mla_kv_a_proj`) or GPT-OSS's sinks (`local_params`), so their split heads are "
              "tp_plan only. A tp_plan's rules are read with every layer number as `*`: blocks (or the repeats of "
              "one block list) placing a module apart are DTensor only, which names each layer. "
              "torchtitan's llama3 / qwen3 tensor-parallel plan is fixed (q / k / v / gate / up column, o / down row, "
              "embedding vocab-parallel, head column, one tensor axis; a qwen3 MoE's router whole, its experts split "
              "by ffn like a dense MLP, or whole under expert parallelism, which borrows the tensor ranks): "
              "`--to torchtitan` refuses other shards. "
              "transformers' expert parallelism (`--to hf-ep-plan`) splits every moe layer's experts over one "
              "group of ranks and shards nothing else by tensor parallelism beside it: its experts are not "
              "tensor-parallel and its expert groups hold the tensor-parallel ranks; its ranks are ordered replicas, "
              "then FSDP ranks, the expert ranks fastest. Megatron's tensor-parallel plan is fixed as torchtitan's is, "
              "with the router replicated and the experts' ffn split like a dense one's."),
    "E1206": ("export: not exported", "A part of the plan the export does not write, which would otherwise be "
              "dropped silently: activation recomputation, data parallelism without ZeRO 2 / 3 (wrap the model in "
              "DistributedDataParallel yourself), or ZeRO over other axes than the batch's (hybrid sharding). For `--to torchtitan`: "
              "`recompute = attention` or `every N` (torchtitan has full and selective AC), the fp8_tensorwise "
              "recipe (torchtitan 0.3's float8 converter is rowwise), part of a block kept in bf16, or an axis "
              "with no role torchtitan has a degree for. For `--to hf-ep-plan`: data parallelism other than ZeRO 3 "
              "over axes that hold the experts' (transformers shards the dense parameters with FSDP2 over "
              "the experts' ranks), experts kept whole, `precision`, a `capacity` (transformers routes dropless) or a "
              "`z_loss_coef`. For `--to megatron`: a precision other than fp32 or bf16 with fp32 master weights "
              "(Megatron keeps fp32 main weights under --bf16), `recompute = ops` or `every N`, fp8_rowwise, bf16 "
              "blocks in the middle of the stack, `compile`, ZeRO over part of the replica axes."),
    "E1207": ("import: an engine argument meshc does not read", "`meshc import-megatron` reads the flags "
              "`meshc export --to megatron` writes (meshllm_dsl/interop/megatron.py's FLAGS: parallel sizes, pipeline "
              "split, ZeRO, recomputation, precision, batch and the model's shape), `meshc import-torchtitan` the "
              "`--section.key` overrides `--to torchtitan` writes (torchtitan.py's KEYS). Any other flag, a flag without "
              "its value, a value of the wrong type, or a value meshllm cannot honour (a recomputation method, a "
              "normalization or activation Megatron's GPT model has but the meshllm families lack, sizes that do "
              "not divide the devices) is an error at that argument, never ignored: an ignored flag would make "
              "the imported plan another run than the one launched."),
    "W1201": ("tp_plan gathers the logits", "transformers computes its loss on full logits, so a head that "
              "meshc keeps vocab-sharded for a vocab-parallel loss is exported as `colwise_gather_output`: the "
              "same loss, with each rank holding the full logits. `--to dtensor` keeps them sharded."),
    "W1202": ("tp_plan leaves data parallelism out", "A tp_plan describes tensor parallelism only; the plan's "
              "data axes (and ZeRO) go to transformers' DistributedConfig or the launcher."),
    "W1203": ("torchtitan masks documents", "torchtitan 0.3's language models always attend block-causally within "
              "the documents its dataloader packs into a row, with positions restarting at each "
              "(models/common/config_utils.py: every attention backend is a masked one; Decoder.get_attention_masks "
              "builds the mask from the per-document positions): the plan `pack = documents` with `positions = "
              "restart` describes. A plan that attends across documents is exported with this warning: on rows "
              "of several documents torchtitan trains the masked run, not the plan's."),
}


# One constant per code; `check_registry` below keeps this list and CODES the same set.
E0101: Final = "E0101"
E0102: Final = "E0102"
E0103: Final = "E0103"
E0104: Final = "E0104"
E0201: Final = "E0201"
E0202: Final = "E0202"
E0203: Final = "E0203"
E0204: Final = "E0204"
E0205: Final = "E0205"
E0301: Final = "E0301"
E0302: Final = "E0302"
E0303: Final = "E0303"
E0304: Final = "E0304"
E0305: Final = "E0305"
E0306: Final = "E0306"
E0307: Final = "E0307"
E0308: Final = "E0308"
E0309: Final = "E0309"
E0310: Final = "E0310"
E0311: Final = "E0311"
E0312: Final = "E0312"
E0313: Final = "E0313"
E0401: Final = "E0401"
E0402: Final = "E0402"
E0403: Final = "E0403"
E0404: Final = "E0404"
E0405: Final = "E0405"
E0406: Final = "E0406"
E0407: Final = "E0407"
E0408: Final = "E0408"
E0409: Final = "E0409"
E0410: Final = "E0410"
E0411: Final = "E0411"
E0412: Final = "E0412"
E0501: Final = "E0501"
E0502: Final = "E0502"
E0503: Final = "E0503"
E0601: Final = "E0601"
E0602: Final = "E0602"
E0603: Final = "E0603"
E0604: Final = "E0604"
E0605: Final = "E0605"
E0606: Final = "E0606"
E0607: Final = "E0607"
E0608: Final = "E0608"
E0609: Final = "E0609"
W0701: Final = "W0701"
W0702: Final = "W0702"
W0703: Final = "W0703"
W0704: Final = "W0704"
W0705: Final = "W0705"
W0706: Final = "W0706"
W0707: Final = "W0707"
W0708: Final = "W0708"
W0709: Final = "W0709"
W0710: Final = "W0710"
W0801: Final = "W0801"
W0802: Final = "W0802"
W0803: Final = "W0803"
W0804: Final = "W0804"
W0805: Final = "W0805"
W0806: Final = "W0806"
W0807: Final = "W0807"
W0808: Final = "W0808"
W0809: Final = "W0809"
E1201: Final = "E1201"
E1202: Final = "E1202"
E1203: Final = "E1203"
E1204: Final = "E1204"
E1205: Final = "E1205"
E1206: Final = "E1206"
E1207: Final = "E1207"
W1201: Final = "W1201"
W1202: Final = "W1202"
W1203: Final = "W1203"


def check_registry(names: Iterable[str], explained: Mapping[str, object]) -> None:
    """Every code constant among `names` has an explanation and every explanation a constant."""
    constants = {n for n in names if re.fullmatch(r"[EW]\d{4}", n)}
    if constants != set(explained):
        missing = sorted(constants - set(explained))
        unused = sorted(set(explained) - constants)
        raise ImportError(f"diagnostic codes out of step: constants without an explanation {missing}, "
                          f"explanations without a constant {unused}")


check_registry(globals(), CODES)


def explain(code: str) -> str | None:
    entry = CODES.get(code.upper())
    if entry is None:
        return None
    title, text = entry
    return f"{code.upper()}: {title}\n\n{text}\n"
