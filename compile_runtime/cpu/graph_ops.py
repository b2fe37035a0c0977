"""Which torch ops a CPU graph capture lets through, calls back into torch, or refuses.

``cpu_graph._RecordingMode`` sees every op a captured step runs outside our native calls
and Inductor's kernels. An op named here passes (it allocates, views, or is already what
was asked for) or becomes a C callback into torch at replay; any other op that computes
refuses the capture, naming itself.
"""

from __future__ import annotations

# Ops that allocate: what they make is the graph's own memory (its pool).
ALLOCATING = frozenset(
    {
        "aten::empty",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
# Ops that only allocate or view memory: what they make is kept, they need no replay.
NO_COMPUTE = ALLOCATING | frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::as_strided",
        "aten::t",
        "aten::transpose",
        "aten::permute",
        "aten::slice",
        "aten::select",
        "aten::narrow",
        "aten::unsqueeze",
        "aten::squeeze",
        "aten::expand",
        "aten::alias",
        "aten::detach",
        "aten::split",
        "aten::split_with_sizes",
        "aten::unbind",
    }
)
# Ops with no native entry of ours that a replay calls back into torch for (oneDNN's packed
# linear and ``F.linear``: float linears whose rows ``cpu_linear`` gives a GEMM): their result is copied into the tensor the
# capture returned, which the later calls read.
# The tensor-parallel all-reduce (in place, as Inductor lowers it) and its wait are called back
# too: each rank's replay runs the collective where its capture did, in the same order.
CALLED_BACK = frozenset(
    {
        "mkldnn::_linear_pointwise",
        "aten::linear",
        "aten::mm",
        "aten::addmm",
        "_c10d_functional::all_reduce_",
        "_c10d_functional::wait_tensor",
    }
)
# Ops that return their input itself when it already has the dtype or layout asked for; when
# they copy (a quantized LM head widens 16-bit activations to float32), they are called back.
MAYBE_NO_COMPUTE = frozenset({"aten::to", "aten::contiguous"})
