//! Graphs and stream capture.
//!
//! A graph is a list of nodes; topology is ignored because the engine runs a launched graph's
//! kernels back to back on the launch stream's device. Launches and `cuMemAllocAsync` /
//! `cuMemFreeAsync` on a capturing stream add kernel, allocation and free nodes instead of
//! running. Graph memory: an allocation node gets its address when it is created; an
//! instantiated graph charges the sum of its allocation nodes at its first launch (frees inside
//! the graph do not reduce it) and keeps the charge until `cuGraphExecDestroy` or
//! `cuDeviceGraphMemTrim` (after which the next launch charges again).

use std::cell::Cell;
use std::ffi::{c_char, c_ulonglong};

use crate::cuda::*;
use crate::engine::Target;
use crate::ffi::{CuResult, cu, get, put, write_c_string};
use crate::memory::Alloc;
use crate::state::{Capture, State, initialised, sleep_until};

pub enum NodeKind {
    Kernel { duration_ns: u64 },
    MemAlloc { phys: usize, bytes: u64, dptr: u64 },
    MemFree,
    Empty,
}

pub struct Node {
    pub kind: NodeKind,
}

#[derive(Default)]
pub struct Graph {
    pub nodes: Vec<usize>,
}

pub struct Exec {
    pub kernels_ns: u64,
    /// When its upload ends (ns, `CLOCK_MONOTONIC`); `None` until its first launch.
    pub uploaded_at: Option<u64>,
    /// (device, bytes) of each allocation node.
    pub allocs: Vec<(usize, u64)>,
    pub charged: bool,
}

impl State {
    fn create_graph(&mut self) -> usize {
        let handle = self.new_handle();
        self.graphs.insert(handle, Graph::default());
        handle
    }

    fn add_node(&mut self, graph: usize, kind: NodeKind) -> CuResult<usize> {
        if !self.graphs.contains_key(&graph) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = self.new_handle();
        self.nodes.insert(handle, Node { kind });
        if let Some(g) = self.graphs.get_mut(&graph) {
            g.nodes.push(handle);
        }
        Ok(handle)
    }

    fn kernel_node(&mut self, graph: usize, function: usize) -> CuResult<usize> {
        let duration_ns = self
            .functions
            .get(&function)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .duration_ns;
        self.add_node(graph, NodeKind::Kernel { duration_ns })
    }

    /// An allocation node: its address is taken now, its memory charged at the first launch.
    fn alloc_node(&mut self, graph: usize, bytes: u64, ordinal: CUdevice) -> CuResult<(usize, u64)> {
        if bytes == 0 || !self.graphs.contains_key(&graph) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let phys = self.device(ordinal)?;
        let alloc = Alloc {
            size: bytes,
            charge: 0,
            phys,
            ordinal,
            ctx: 0,
            pool: None,
            graph: true,
        };
        let dptr = self.place(phys, alloc)?;
        let node = self.add_node(graph, NodeKind::MemAlloc { phys, bytes, dptr })?;
        Ok((node, dptr))
    }

    /// The graph a stream's capture builds; work captured into an invalidated capture is
    /// refused, as the driver does.
    fn capture_graph(&self, stream: usize) -> CuResult<usize> {
        match self.streams.get(&stream).and_then(|s| s.capture.as_ref()) {
            Some(capture) if capture.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
            Some(capture) => Ok(capture.graph),
            None => Err(CUDA_ERROR_ILLEGAL_STATE),
        }
    }

    fn captured(&mut self, stream: usize, node: usize) {
        if let Some(capture) = self.streams.get_mut(&stream).and_then(|s| s.capture.as_mut()) {
            capture.deps = vec![node];
            capture.edges = vec![0];
        }
    }

    pub fn capture_kernel(&mut self, stream: usize, duration_ns: u64) -> CuResult {
        let graph = self.capture_graph(stream)?;
        let node = self.add_node(graph, NodeKind::Kernel { duration_ns })?;
        self.captured(stream, node);
        Ok(())
    }

    pub fn capture_alloc(&mut self, stream: usize, bytes: u64, ordinal: CUdevice) -> CuResult<u64> {
        let graph = self.capture_graph(stream)?;
        if let Some(capture) = self.streams.get_mut(&stream).and_then(|s| s.capture.as_mut())
            && let Some(expected) = capture.recaptured_allocs.as_mut()
            && expected.pop_front() != Some(bytes)
        {
            // A recapture fails at once on an allocation unlike the original graph's.
            capture.invalidated = true;
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (node, dptr) = self.alloc_node(graph, bytes, ordinal)?;
        self.captured(stream, node);
        Ok(dptr)
    }

    pub fn capture_free(&mut self, stream: usize) -> CuResult {
        let graph = self.capture_graph(stream)?;
        let node = self.add_node(graph, NodeKind::MemFree)?;
        self.captured(stream, node);
        Ok(())
    }

    fn destroy_graph(&mut self, graph: usize) -> CuResult {
        let g = self.graphs.remove(&graph).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.remove_nodes(g.nodes);
        Ok(())
    }

    /// Removes nodes, giving their allocations' addresses back; the sizes of the allocations, in
    /// order.
    fn remove_nodes(&mut self, nodes: Vec<usize>) -> Vec<u64> {
        let mut sizes = Vec::new();
        for node in nodes {
            if let Some(Node {
                kind: NodeKind::MemAlloc { phys, dptr, bytes },
            }) = self.nodes.remove(&node)
            {
                sizes.push(bytes);
                self.allocs.remove(&dptr);
                if let Some(space) = self.va.get_mut(phys) {
                    space.give_back(dptr);
                }
            }
        }
        sizes
    }

    /// `cuStreamBeginRecaptureToGraph`: the capture records into the graph afresh, its nodes
    /// replaced by the recaptured ones; each allocation must have its original node's size.
    #[cfg_attr(not(cuda_api = "13050"), allow(dead_code))]
    fn begin_recapture(&mut self, stream: CUstream, mode: CUstreamCaptureMode, graph: usize) -> CuResult {
        self.begin_capture(stream, mode, Some(graph))?;
        let nodes = self
            .graphs
            .get_mut(&graph)
            .map(|g| std::mem::take(&mut g.nodes))
            .unwrap_or_default();
        let sizes = self.remove_nodes(nodes);
        let handle = self.stream_target(stream)?.capturing.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if let Some(capture) = self.streams.get_mut(&handle).and_then(|s| s.capture.as_mut()) {
            capture.recaptured_allocs = Some(sizes.into());
        }
        Ok(())
    }

    fn instantiate(&mut self, graph: usize) -> CuResult<usize> {
        let g = self.graphs.get(&graph).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut exec = Exec {
            kernels_ns: 0,
            uploaded_at: None,
            allocs: Vec::new(),
            charged: false,
        };
        for node in &g.nodes {
            match self.nodes.get(node).map(|n| &n.kind) {
                Some(NodeKind::Kernel { duration_ns }) => {
                    exec.kernels_ns = exec.kernels_ns.saturating_add(*duration_ns)
                }
                Some(NodeKind::MemAlloc { phys, bytes, .. }) => exec.allocs.push((*phys, *bytes)),
                _ => {}
            }
        }
        let handle = self.new_handle();
        self.execs.insert(handle, exec);
        Ok(handle)
    }

    /// The first launch of an executable graph uploads it (`FAKE_CUDA_MODULE_LOAD_US` of host
    /// time, as lazy loading takes for a function): returns when the upload ends.
    fn upload_graph(&mut self, exec: usize, stream: CUstream) -> CuResult<u64> {
        if self.stream_target(stream)?.capturing.is_some() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let e = self.execs.get_mut(&exec).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(crate::engine::first_launch_ends(&mut e.uploaded_at))
    }

    fn launch_graph(&mut self, exec: usize, stream: CUstream) -> CuResult {
        let target: Target = self.stream_target(stream)?;
        if target.capturing.is_some() {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let e = self.execs.get(&exec).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (kernels_ns, allocs, charged) = (e.kernels_ns, e.allocs.clone(), e.charged);
        if !charged {
            for (i, &(phys, bytes)) in allocs.iter().enumerate() {
                if let Err(error) = self.charge(phys, bytes) {
                    for &(phys, bytes) in &allocs[..i] {
                        self.uncharge(phys, bytes);
                    }
                    return Err(error);
                }
            }
            if let Some(e) = self.execs.get_mut(&exec) {
                e.charged = true;
            }
        }
        self.enqueue(&target, kernels_ns);
        Ok(())
    }

    fn uncharge_exec(&mut self, exec: usize) {
        let Some(e) = self.execs.get_mut(&exec) else { return };
        if !e.charged {
            return;
        }
        e.charged = false;
        for (phys, bytes) in e.allocs.clone() {
            self.uncharge(phys, bytes);
        }
    }

    /// A potentially unsafe call (`cuStreamQuery`, `cuEventQuery`, `cuMemPoolGetAttribute`, as
    /// the H200 answers them: `tests/gpu/capture_probe.py`) made by this thread while
    /// captures are under way: as `cuThreadExchangeStreamCaptureMode` documents, it is refused,
    /// and the captures whose mode forbids it are invalidated, unless this thread is in relaxed
    /// mode. A capture forbids it from its own thread unless it began relaxed, and from any other
    /// thread in global mode when it began in global mode.
    pub fn refuse_unsafe_call(&mut self) -> CuResult {
        let mode = THREAD_CAPTURE_MODE.with(Cell::get);
        if mode == CU_STREAM_CAPTURE_MODE_RELAXED {
            return Ok(());
        }
        let me = std::thread::current().id();
        let mut refused = false;
        for capture in self.streams.values_mut().filter_map(|s| s.capture.as_mut()) {
            let forbids = if capture.thread == me {
                capture.mode != CU_STREAM_CAPTURE_MODE_RELAXED
            } else {
                capture.mode == CU_STREAM_CAPTURE_MODE_GLOBAL && mode == CU_STREAM_CAPTURE_MODE_GLOBAL
            };
            if forbids {
                capture.invalidated = true;
                refused = true;
            }
        }
        if refused {
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// Begins a capture into `into` (an existing graph) or a new graph.
    fn begin_capture(&mut self, stream: CUstream, mode: CUstreamCaptureMode, into: Option<usize>) -> CuResult {
        let target = self.stream_target(stream)?;
        let handle = target.stream.ok_or(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)?;
        if target.capturing.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        if into.is_some_and(|graph| !self.graphs.contains_key(&graph)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let graph = match into {
            Some(graph) => graph,
            None => self.create_graph(),
        };
        let id = self.next_capture_id;
        self.next_capture_id += 1;
        if let Some(s) = self.streams.get_mut(&handle) {
            s.capture = Some(Capture {
                graph,
                id,
                deps: Vec::new(),
                edges: Vec::new(),
                invalidated: false,
                mode,
                thread: std::thread::current().id(),
                into_existing: into.is_some(),
                recaptured_allocs: None,
            });
        }
        Ok(())
    }

    fn end_capture(&mut self, stream: CUstream) -> CuResult<usize> {
        let target = self.stream_target(stream)?;
        let handle = target.capturing.ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        let capture = self
            .streams
            .get_mut(&handle)
            .and_then(|s| s.capture.take())
            .ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if capture.invalidated {
            // The driver destroys the graph of a capture that failed, its allocation nodes too
            // (not the application's own graph captured into).
            if !capture.into_existing {
                self.destroy_graph(capture.graph)?;
            }
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        Ok(capture.graph)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphCreate(phGraph: *mut CUgraph, _flags: std::ffi::c_uint) -> CUresult {
    cu(|| {
        if phGraph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = initialised()?.create_graph();
        // SAFETY: out-pointer from the caller, checked non-null.
        unsafe { put(phGraph, handle as CUgraph) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphDestroy(hGraph: CUgraph) -> CUresult {
    cu(|| initialised()?.destroy_graph(hGraph as usize))
}

fn put_node(ph: *mut CUgraphNode, node: usize) -> CuResult {
    // SAFETY: out-pointer from the caller.
    unsafe { put(ph, node as CUgraphNode) }
}

fn kernel_of(func: CUfunction, kern: CUkernel) -> usize {
    if func.is_null() { kern as usize } else { func as usize }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddKernelNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
    nodeParams: *const CUDA_KERNEL_NODE_PARAMS_v1,
) -> CUresult {
    cu(|| {
        // SAFETY: the caller passes valid node parameters (null is rejected).
        let params = unsafe { get(nodeParams) }?;
        if phGraphNode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let node = initialised()?.kernel_node(hGraph as usize, params.func as usize)?;
        put_node(phGraphNode, node)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddKernelNode_v2(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
    nodeParams: *const CUDA_KERNEL_NODE_PARAMS,
) -> CUresult {
    cu(|| {
        // SAFETY: the caller passes valid node parameters (null is rejected).
        let params = unsafe { get(nodeParams) }?;
        if phGraphNode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let node = initialised()?.kernel_node(hGraph as usize, kernel_of(params.func, params.kern))?;
        put_node(phGraphNode, node)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemAllocNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
    nodeParams: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    cu(|| {
        // SAFETY: the caller passes valid node parameters (null is rejected).
        let params = unsafe { get(nodeParams.cast_const()) }?;
        if phGraphNode.is_null() || params.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (node, dptr) =
            initialised()?.alloc_node(hGraph as usize, params.bytesize as u64, params.poolProps.location.id())?;
        // SAFETY: `nodeParams` is valid (read above); the driver returns the address in it.
        unsafe { put(&raw mut (*nodeParams).dptr, dptr) }?;
        put_node(phGraphNode, node)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddMemFreeNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
    dptr: CUdeviceptr,
) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        if phGraphNode.is_null() || !state.allocs.get(&dptr).is_some_and(|a| a.graph) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let node = state.add_node(hGraph as usize, NodeKind::MemFree)?;
        put_node(phGraphNode, node)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddEmptyNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
) -> CUresult {
    cu(|| {
        if phGraphNode.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let node = initialised()?.add_node(hGraph as usize, NodeKind::Empty)?;
        put_node(phGraphNode, node)
    })
}

fn add_generic_node(phGraphNode: *mut CUgraphNode, hGraph: CUgraph, nodeParams: *mut CUgraphNodeParams) -> CuResult {
    // SAFETY: the caller passes valid node parameters (null is rejected).
    let params = unsafe { get(nodeParams.cast_const()) }?;
    if phGraphNode.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let graph = hGraph as usize;
    let mut state = initialised()?;
    let node = match params.type_ {
        CU_GRAPH_NODE_TYPE_KERNEL => {
            // SAFETY: `type_` says the kernel member is the one in use.
            let kernel = unsafe { params.__bindgen_anon_1.kernel };
            state.kernel_node(graph, kernel_of(kernel.func, kernel.kern))?
        }
        CU_GRAPH_NODE_TYPE_MEM_ALLOC => {
            // SAFETY: `type_` says the alloc member is the one in use.
            let alloc = unsafe { params.__bindgen_anon_1.alloc };
            if alloc.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let (node, dptr) = state.alloc_node(graph, alloc.bytesize as u64, alloc.poolProps.location.id())?;
            // SAFETY: `nodeParams` is valid (read above); the driver returns the address in it.
            unsafe { put(&raw mut (*nodeParams).__bindgen_anon_1.alloc.dptr, dptr) }?;
            node
        }
        CU_GRAPH_NODE_TYPE_MEM_FREE => state.add_node(graph, NodeKind::MemFree)?,
        CU_GRAPH_NODE_TYPE_EMPTY => state.add_node(graph, NodeKind::Empty)?,
        _ => return Err(CUDA_ERROR_NOT_SUPPORTED),
    };
    put_node(phGraphNode, node)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddNode(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _numDependencies: usize,
    nodeParams: *mut CUgraphNodeParams,
) -> CUresult {
    cu(|| add_generic_node(phGraphNode, hGraph, nodeParams))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddNode_v2(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _dependencyData: *const CUgraphEdgeData,
    _numDependencies: usize,
    nodeParams: *mut CUgraphNodeParams,
) -> CUresult {
    cu(|| add_generic_node(phGraphNode, hGraph, nodeParams))
}

/// CUDA 13.5: as `_v2` (kernel nodes may name a context, which the fake does not check).
#[cfg(cuda_api = "13050")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphAddNode_v3(
    phGraphNode: *mut CUgraphNode,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _dependencyData: *const CUgraphEdgeData,
    _numDependencies: usize,
    nodeParams: *mut CUgraphNodeParams,
) -> CUresult {
    cu(|| add_generic_node(phGraphNode, hGraph, nodeParams))
}

fn instantiate(phGraphExec: *mut CUgraphExec, hGraph: CUgraph) -> CuResult {
    if phGraphExec.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let exec = initialised()?.instantiate(hGraph as usize)?;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(phGraphExec, exec as CUgraphExec) }
}

fn instantiate_with_log(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    phErrorNode: *mut CUgraphNode,
    logBuffer: *mut c_char,
    bufferSize: usize,
) -> CuResult {
    instantiate(phGraphExec, hGraph)?;
    if !phErrorNode.is_null() {
        put_node(phErrorNode, 0)?;
    }
    // SAFETY: the caller's log buffer holds `bufferSize` bytes (nothing is written if null).
    unsafe { write_c_string(logBuffer, bufferSize, "") };
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiate(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    phErrorNode: *mut CUgraphNode,
    logBuffer: *mut c_char,
    bufferSize: usize,
) -> CUresult {
    cu(|| instantiate_with_log(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiate_v2(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    phErrorNode: *mut CUgraphNode,
    logBuffer: *mut c_char,
    bufferSize: usize,
) -> CUresult {
    cu(|| instantiate_with_log(phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    _flags: c_ulonglong,
) -> CUresult {
    cu(|| instantiate(phGraphExec, hGraph))
}

fn instantiate_with_params(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CuResult {
    if params.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    instantiate(phGraphExec, hGraph)?;
    // SAFETY: `params` is a valid, non-null CUDA_GRAPH_INSTANTIATE_PARAMS of the caller.
    unsafe {
        put(&raw mut (*params).hErrNode_out, std::ptr::null_mut())?;
        put(&raw mut (*params).result_out, CUDA_GRAPH_INSTANTIATE_SUCCESS)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithParams(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    instantiateParams: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CUresult {
    cu(|| instantiate_with_params(phGraphExec, hGraph, instantiateParams))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphInstantiateWithParams_ptsz(
    phGraphExec: *mut CUgraphExec,
    hGraph: CUgraph,
    instantiateParams: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CUresult {
    cu(|| instantiate_with_params(phGraphExec, hGraph, instantiateParams))
}

/// A graph launch; the first of each executable graph waits for its upload first (without the
/// state's lock).
fn graph_launch(exec: CUgraphExec, stream: CUstream) -> CuResult {
    let uploaded = initialised()?.upload_graph(exec as usize, stream)?;
    sleep_until(uploaded);
    initialised()?.launch_graph(exec as usize, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch(hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
    cu(|| graph_launch(hGraphExec, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphLaunch_ptsz(hGraphExec: CUgraphExec, hStream: CUstream) -> CUresult {
    cu(|| graph_launch(hGraphExec, hStream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGraphExecDestroy(hGraphExec: CUgraphExec) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        if !state.execs.contains_key(&(hGraphExec as usize)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(exec) = state.execs.remove(&(hGraphExec as usize))
            && exec.charged
        {
            state.retained_graph_memory.extend(exec.allocs);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGraphMemTrim(device: CUdevice) -> CUresult {
    cu(|| {
        let mut state = initialised()?;
        let phys = state.device(device)?;
        let execs: Vec<usize> = state
            .execs
            .iter()
            .filter(|(_, e)| e.allocs.iter().any(|(p, _)| *p == phys))
            .map(|(h, _)| *h)
            .collect();
        for exec in execs {
            state.uncharge_exec(exec);
        }
        let (trimmed, kept) = std::mem::take(&mut state.retained_graph_memory)
            .into_iter()
            .partition(|(p, _)| *p == phys);
        state.retained_graph_memory = kept;
        for (phys, bytes) in trimmed {
            state.uncharge(phys, bytes);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetGraphMemAttribute(
    device: CUdevice,
    attr: CUgraphMem_attribute,
    value: *mut std::ffi::c_void,
) -> CUresult {
    cu(|| {
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let state = initialised()?;
        let phys = state.device(device)?;
        let in_execs: u64 = state
            .execs
            .values()
            .filter(|e| e.charged)
            .flat_map(|e| e.allocs.iter())
            .filter(|(p, _)| *p == phys)
            .map(|(_, bytes)| bytes)
            .sum();
        let retained: u64 = state
            .retained_graph_memory
            .iter()
            .filter(|(p, _)| *p == phys)
            .map(|(_, bytes)| bytes)
            .sum();
        let word = match attr {
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT | CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH => in_execs + retained,
            CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT | CU_GRAPH_MEM_ATTR_USED_MEM_HIGH => in_execs,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        // SAFETY: out-pointer from the caller, checked non-null; these attributes are cuuint64_t.
        unsafe { put(value.cast::<u64>(), word) }
    })
}

thread_local! {
    /// The calling thread's stream capture interaction mode (`cuThreadExchangeStreamCaptureMode`).
    static THREAD_CAPTURE_MODE: Cell<CUstreamCaptureMode> = const { Cell::new(CU_STREAM_CAPTURE_MODE_GLOBAL) };
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut CUstreamCaptureMode) -> CUresult {
    cu(|| {
        // SAFETY: the caller's in/out pointer (null is rejected).
        let wanted = known_mode(unsafe { get(mode.cast_const()) }?)?;
        let previous = THREAD_CAPTURE_MODE.with(|current| current.replace(wanted));
        // SAFETY: the same pointer, read above.
        unsafe { put(mode, previous) }
    })
}

/// `mode` when it is one of the three capture modes, else `CUDA_ERROR_INVALID_VALUE`.
fn known_mode(mode: CUstreamCaptureMode) -> CuResult<CUstreamCaptureMode> {
    match mode {
        CU_STREAM_CAPTURE_MODE_GLOBAL | CU_STREAM_CAPTURE_MODE_THREAD_LOCAL | CU_STREAM_CAPTURE_MODE_RELAXED => {
            Ok(mode)
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

fn begin_capture(stream: CUstream, mode: CUstreamCaptureMode) -> CuResult {
    initialised()?.begin_capture(stream, known_mode(mode)?, None)
}

/// `cuStreamBeginCaptureToGraph`: the dependencies are not modelled (the capture starts with
/// none).
fn begin_capture_to_graph(stream: CUstream, graph: CUgraph, mode: CUstreamCaptureMode) -> CuResult {
    initialised()?.begin_capture(stream, known_mode(mode)?, Some(graph as usize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph(
    hStream: CUstream,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _dependencyData: *const CUgraphEdgeData,
    _numDependencies: usize,
    mode: CUstreamCaptureMode,
) -> CUresult {
    cu(|| begin_capture_to_graph(hStream, hGraph, mode))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph_ptsz(
    hStream: CUstream,
    hGraph: CUgraph,
    _dependencies: *const CUgraphNode,
    _dependencyData: *const CUgraphEdgeData,
    _numDependencies: usize,
    mode: CUstreamCaptureMode,
) -> CUresult {
    cu(|| begin_capture_to_graph(hStream, hGraph, mode))
}

#[cfg(cuda_api = "13050")]
fn begin_recapture_to_graph(stream: CUstream, mode: CUstreamCaptureMode, graph: CUgraph) -> CuResult {
    initialised()?.begin_recapture(stream, known_mode(mode)?, graph as usize)
}

/// `cuStreamBeginRecaptureToGraph` (CUDA 13.5): the callback for other parameters' mismatches
/// is not modelled (the fake compares allocation sizes only).
#[cfg(cuda_api = "13050")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginRecaptureToGraph(
    hStream: CUstream,
    mode: CUstreamCaptureMode,
    hGraph: CUgraph,
    _callbackFunc: CUgraphRecaptureCallback,
    _userData: *mut std::ffi::c_void,
) -> CUresult {
    cu(|| begin_recapture_to_graph(hStream, mode, hGraph))
}

#[cfg(cuda_api = "13050")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginRecaptureToGraph_ptsz(
    hStream: CUstream,
    mode: CUstreamCaptureMode,
    hGraph: CUgraph,
    _callbackFunc: CUgraphRecaptureCallback,
    _userData: *mut std::ffi::c_void,
) -> CUresult {
    cu(|| begin_recapture_to_graph(hStream, mode, hGraph))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture(hStream: CUstream) -> CUresult {
    cu(|| begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_ptsz(hStream: CUstream) -> CUresult {
    cu(|| begin_capture(hStream, CU_STREAM_CAPTURE_MODE_GLOBAL))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(hStream: CUstream, mode: CUstreamCaptureMode) -> CUresult {
    cu(|| begin_capture(hStream, mode))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(hStream: CUstream, mode: CUstreamCaptureMode) -> CUresult {
    cu(|| begin_capture(hStream, mode))
}

fn end_capture(stream: CUstream, phGraph: *mut CUgraph) -> CuResult {
    if phGraph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let graph = initialised()?.end_capture(stream)?;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(phGraph, graph as CUgraph) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
    cu(|| end_capture(hStream, phGraph))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(hStream: CUstream, phGraph: *mut CUgraph) -> CUresult {
    cu(|| end_capture(hStream, phGraph))
}

fn is_capturing(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CuResult {
    let state = initialised()?;
    let capture = state
        .stream_target(stream)?
        .capturing
        .and_then(|handle| state.streams.get(&handle))
        .and_then(|s| s.capture.as_ref());
    let value = match capture {
        Some(capture) if capture.invalidated => CU_STREAM_CAPTURE_STATUS_INVALIDATED,
        Some(_) => CU_STREAM_CAPTURE_STATUS_ACTIVE,
        None => CU_STREAM_CAPTURE_STATUS_NONE,
    };
    // SAFETY: out-pointer from the caller.
    unsafe { put(status, value) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(hStream: CUstream, captureStatus: *mut CUstreamCaptureStatus) -> CUresult {
    cu(|| is_capturing(hStream, captureStatus))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing_ptsz(
    hStream: CUstream,
    captureStatus: *mut CUstreamCaptureStatus,
) -> CUresult {
    cu(|| is_capturing(hStream, captureStatus))
}

/// `cuStreamGetCaptureInfo` in all its forms; every output but the status is optional.
fn capture_info(
    stream: CUstream,
    status: *mut CUstreamCaptureStatus,
    id: *mut cuuint64_t,
    graph: *mut CUgraph,
    deps: *mut *const CUgraphNode,
    edges: *mut *const CUgraphEdgeData,
    count: *mut usize,
) -> CuResult {
    if status.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let state = initialised()?;
    let target = state.stream_target(stream)?;
    let capture = target
        .capturing
        .and_then(|h| state.streams.get(&h))
        .and_then(|s| s.capture.as_ref());
    // SAFETY: every pointer is an optional out-pointer of the caller, written only if non-null;
    // the dependency and edge arrays live in the stream's capture until its next change.
    unsafe {
        let Some(capture) = capture else {
            return put(status, CU_STREAM_CAPTURE_STATUS_NONE);
        };
        let value = if capture.invalidated {
            CU_STREAM_CAPTURE_STATUS_INVALIDATED
        } else {
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        };
        put(status, value)?;
        if !id.is_null() {
            put(id, capture.id)?;
        }
        if !graph.is_null() {
            put(graph, capture.graph as CUgraph)?;
        }
        if !deps.is_null() {
            put(deps, capture.deps.as_ptr().cast::<CUgraphNode>())?;
        }
        if !edges.is_null() {
            put(edges, capture.edges.as_ptr().cast::<CUgraphEdgeData>())?;
        }
        if !count.is_null() {
            put(count, capture.deps.len())?;
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
) -> CUresult {
    let null = std::ptr::null_mut();
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            null,
            null.cast(),
            null.cast(),
            null.cast(),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_ptsz(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
) -> CUresult {
    let null = std::ptr::null_mut();
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            null,
            null.cast(),
            null.cast(),
            null.cast(),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const CUgraphNode,
    numDependencies_out: *mut usize,
) -> CUresult {
    let edges = std::ptr::null_mut();
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            graph_out,
            dependencies_out,
            edges,
            numDependencies_out,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2_ptsz(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const CUgraphNode,
    numDependencies_out: *mut usize,
) -> CUresult {
    let edges = std::ptr::null_mut();
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            graph_out,
            dependencies_out,
            edges,
            numDependencies_out,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const CUgraphNode,
    edgeData_out: *mut *const CUgraphEdgeData,
    numDependencies_out: *mut usize,
) -> CUresult {
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            graph_out,
            dependencies_out,
            edgeData_out,
            numDependencies_out,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v3_ptsz(
    hStream: CUstream,
    captureStatus_out: *mut CUstreamCaptureStatus,
    id_out: *mut cuuint64_t,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const CUgraphNode,
    edgeData_out: *mut *const CUgraphEdgeData,
    numDependencies_out: *mut usize,
) -> CUresult {
    cu(|| {
        capture_info(
            hStream,
            captureStatus_out,
            id_out,
            graph_out,
            dependencies_out,
            edgeData_out,
            numDependencies_out,
        )
    })
}
