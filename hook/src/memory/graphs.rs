//! Graph memory: allocation nodes added to a graph or recorded by a stream capture are charged to
//! the graph while it exists; what the device holds for graphs (from an instance's first launch
//! until a trim, after the graph and the instance are gone too) is charged as the device's graph
//! memory beyond that (see [`super::pool_sync::sync_graph_pool`]).

use vgpu_region::MemoryKind;

use super::accounting::{Accounting, accounting};
use super::charge::{charged, released_after};
use super::ledger::{CaptureInto, CaptureKey, Family};
use super::location::device_of;
use super::pool_sync::{sync_graph_pool, sync_graph_pools};
use super::units::read;
use crate::session::current_ordinal;
use crate::sys::cuda::*;

/// Charges an allocation node of `bytes` in the pool at `location` to `graph`.
fn graph_alloc_node(
    call: impl FnOnce() -> CUresult,
    graph: CUgraph,
    bytes: usize,
    location: CUmemLocation,
) -> CUresult {
    if bytes == 0 {
        return call();
    }
    graph_charged(device_of(&location), bytes as u64, call, graph)
}

/// Charges graph memory to `graph` on `ordinal` (or the current device), and follows that
/// device's graph memory from now on.
fn graph_charged(ordinal: Option<CUdevice>, bytes: u64, call: impl FnOnce() -> CUresult, graph: CUgraph) -> CUresult {
    if let Some(accounting) = accounting()
        && let Some(ordinal) = ordinal.or_else(current_ordinal)
    {
        accounting.ledger().note_graph_memory(ordinal);
    }
    charged(ordinal, MemoryKind::Data, bytes, call, Family::Graph, || {
        Some(graph as u64)
    })
}

/// `cuGraphAddMemAllocNode`: the node's bytes are charged while the graph exists.
pub fn graph_add_mem_alloc_node(
    call: impl FnOnce() -> CUresult,
    h_graph: CUgraph,
    node_params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires valid parameters.
    let Some(params) = (unsafe { read(node_params) }) else {
        return call();
    };
    graph_alloc_node(call, h_graph, params.bytesize, params.poolProps.location)
}

/// The `cuGraphAddNode` family: charged like `cuGraphAddMemAllocNode` for memory allocation
/// nodes.
pub fn graph_add_node(
    call: impl FnOnce() -> CUresult,
    h_graph: CUgraph,
    node_params: *mut CUgraphNodeParams,
) -> CUresult {
    // SAFETY: null is checked; otherwise the driver requires valid parameters.
    let Some(params) = (unsafe { node_params.as_ref() }) else {
        return call();
    };
    if params.type_ != CU_GRAPH_NODE_TYPE_MEM_ALLOC {
        return call();
    }
    // SAFETY: the type says the union holds allocation parameters.
    let alloc = unsafe { params.__bindgen_anon_1.alloc };
    graph_alloc_node(call, h_graph, alloc.bytesize, alloc.poolProps.location)
}

/// `cuGraphDestroy`: releases its memory nodes' charges; what the device still holds for
/// graphs (its executables keep their memory) stays charged as graph memory, recorded first.
pub fn graph_destroy(call: impl FnOnce() -> CUresult, h_graph: CUgraph) -> CUresult {
    released_after(Family::Graph, h_graph as u64, call, |accounting, _| {
        sync_graph_pools(accounting)
    })
}

/// `cuDeviceGraphMemTrim`: the device gives back the graph memory no executing graph uses.
pub fn graph_mem_trim(call: impl FnOnce() -> CUresult, device: CUdevice) -> CUresult {
    let result = call();
    if let Some(accounting) = accounting()
        && accounting.ledger().has_graph_memory(device)
    {
        sync_graph_pool(accounting, device);
    }
    result
}

/// An allocation recorded into a capture's graph: charged to the graph, as an allocation node
/// added to it is, on the pool's device when it is known; the capture's graph is remembered for
/// the end of the capture. A recapture's allocation takes the place of a node charged already.
pub(super) fn captured_alloc(
    call: impl FnOnce() -> CUresult,
    accounting: Accounting,
    capture: CaptureKey,
    graph: CUgraph,
    dptr: *mut CUdeviceptr,
    bytes: usize,
    ordinal: Option<CUdevice>,
) -> CUresult {
    if dptr.is_null() || bytes == 0 {
        return call();
    }
    if let Some(CaptureInto::Recapture(_)) = accounting.ledger().capture(capture) {
        return call();
    }
    let result = graph_charged(ordinal, bytes as u64, call, graph);
    if result == CUDA_SUCCESS {
        accounting
            .ledger()
            .remember_capture(capture, CaptureInto::DriverGraph(graph as u64));
    }
    result
}

/// `cuStreamEndCapture` and `_ptsz`: a capture that ends invalidated leaves no graph (the driver
/// destroys the one it made), so what its allocations were charged is released; the
/// application's own graph (`cuStreamBeginCaptureToGraph`, `cuStreamBeginRecaptureToGraph`)
/// keeps its charges until it is destroyed. Any other error leaves the capture going on.
pub fn end_capture(call: impl FnOnce() -> CUresult, h_stream: CUstream, per_thread: bool) -> CUresult {
    let Some(accounting) = accounting() else { return call() };
    let key = crate::capture::capture_key(h_stream, per_thread);
    let result = call();
    if result != CUDA_SUCCESS && result != CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
        return result;
    }
    if let Some(CaptureInto::DriverGraph(graph)) = accounting.ledger().take_capture(key)
        && result == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    {
        // The driver has destroyed the graph already.
        released_after(
            Family::Graph,
            graph,
            || CUDA_SUCCESS,
            |accounting, _| sync_graph_pools(accounting),
        );
    }
    result
}

/// `cuStreamBeginCaptureToGraph` and `_ptsz`: the capture records into the application's graph,
/// which a failed capture does not destroy.
pub fn begin_capture_to_graph(
    call: impl FnOnce() -> CUresult,
    h_stream: CUstream,
    h_graph: CUgraph,
    per_thread: bool,
) -> CUresult {
    began_capture(
        call,
        h_stream,
        per_thread,
        CaptureInto::ApplicationGraph(h_graph as u64),
    )
}

/// `cuStreamBeginRecaptureToGraph` and `_ptsz` (CUDA 13.5): the capture records the
/// application's graph again, node for node; the driver refuses an allocation whose size is not
/// the original node's, so the graph's charges stand for the recaptured nodes and its
/// allocations are not charged again. A failed recapture leaves the graph to be destroyed.
pub fn begin_recapture_to_graph(
    call: impl FnOnce() -> CUresult,
    h_stream: CUstream,
    h_graph: CUgraph,
    per_thread: bool,
) -> CUresult {
    began_capture(call, h_stream, per_thread, CaptureInto::Recapture(h_graph as u64))
}

/// A capture into the application's graph that the call begins is remembered for its stream.
fn began_capture(call: impl FnOnce() -> CUresult, h_stream: CUstream, per_thread: bool, into: CaptureInto) -> CUresult {
    let result = call();
    if result == CUDA_SUCCESS
        && let Some(accounting) = accounting()
    {
        let key = crate::capture::capture_key(h_stream, per_thread);
        accounting.ledger().begin_capture(key, into);
    }
    result
}
