//! The per-process state of the fake driver: one `Mutex<State>` (never held while sleeping), the
//! calling thread's context stack, and the ground-truth record.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{LazyLock, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crate::config::{self, Config};
use crate::cuda::*;
use crate::ffi::CuResult;
use crate::graph::{Exec, Graph, Node};
use crate::memory::{Alloc, VaSpace};
use crate::module::{Function, Module};
use crate::pool::Pool;
use crate::truth::{self, MAX_DEVICES, Truth};
use crate::vmm::Physical;

/// First handle value; handles of every kind share one counter, so a handle of the wrong kind is
/// never found (`CUDA_ERROR_INVALID_HANDLE`), and none collides with `CU_STREAM_LEGACY` (1) or
/// `CU_STREAM_PER_THREAD` (2).
const FIRST_HANDLE: usize = 0x10_0000;

pub const STREAM_LEGACY: usize = 1;
pub const STREAM_PER_THREAD: usize = 2;

pub struct Context {
    pub ordinal: i32,
    pub phys: usize,
    pub primary: bool,
    /// False for a primary context while it is not retained.
    pub active: bool,
}

pub struct Primary {
    pub handle: usize,
    pub retain: u32,
    pub flags: u32,
}

pub struct Stream {
    pub ordinal: i32,
    pub phys: usize,
    /// End time (ns, `CLOCK_MONOTONIC`) of the last work queued on the stream.
    pub last_end: u64,
    /// Work queued later may not start before this (from `cuStreamWaitEvent`).
    pub wait_until: u64,
    pub capture: Option<Capture>,
}

pub struct Capture {
    pub graph: usize,
    pub id: u64,
    /// The last captured node, as `CUgraphNode` values (for `cuStreamGetCaptureInfo`).
    pub deps: Vec<usize>,
    /// Default edge data, one word per dependency.
    pub edges: Vec<u64>,
    /// A call the capture does not allow was made on the stream (`cuStreamQuery`), or a
    /// potentially unsafe call where its mode forbids one: ending the capture fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, as on a real driver.
    pub invalidated: bool,
    /// The mode it began with (`cuStreamBeginCapture_v2`; global without one).
    pub mode: CUstreamCaptureMode,
    /// The thread that began it.
    pub thread: std::thread::ThreadId,
    /// It records into the application's graph (`cuStreamBeginCaptureToGraph`), which ending it
    /// invalidated leaves in place.
    pub into_existing: bool,
    /// A recapture (`cuStreamBeginRecaptureToGraph`): the sizes of the graph's allocation nodes
    /// not recaptured yet, in order; an allocation of another size fails the recapture.
    pub recaptured_allocs: Option<std::collections::VecDeque<u64>>,
}

pub struct Event {
    pub flags: u32,
    /// When the work before the last record completes; `None` until recorded.
    pub done_at: Option<u64>,
}

/// The context a call runs in.
#[derive(Clone, Copy)]
pub struct Current {
    pub ctx: usize,
    pub ordinal: i32,
    pub phys: usize,
}

pub struct State {
    pub initialised: bool,
    pub truth: Option<&'static Truth>,
    pub slot: usize,
    pub pid: u32,
    next_handle: usize,
    pub next_capture_id: u64,
    pub contexts: HashMap<usize, Context>,
    pub primary: Vec<Primary>,
    pub allocs: BTreeMap<u64, Alloc>,
    /// Where the pages of each managed allocation (by base address) live.
    pub managed: HashMap<u64, crate::managed::Pages>,
    pub va: Vec<VaSpace>,
    pub reserved_va: VaSpace,
    pub pools: HashMap<usize, Pool>,
    /// The current pool of each CUDA ordinal (the default pool until `cuDeviceSetMemPool`).
    pub current_pool: Vec<Option<usize>>,
    pub default_pool: Vec<Option<usize>>,
    pub physical: HashMap<u64, Physical>,
    /// VMM address reservations: start -> size.
    pub reservations: BTreeMap<u64, u64>,
    /// VMM mappings: start -> (size, physical handle).
    pub mappings: BTreeMap<u64, (u64, u64)>,
    pub arrays: HashMap<usize, crate::array::Array>,
    /// Imported external memory objects.
    pub externals: HashMap<usize, crate::external::External>,
    pub mipmaps: HashMap<usize, crate::array::Array>,
    pub modules: HashMap<usize, Module>,
    pub functions: HashMap<usize, Function>,
    pub streams: HashMap<usize, Stream>,
    pub events: HashMap<usize, Event>,
    pub graphs: HashMap<usize, Graph>,
    pub nodes: HashMap<usize, Node>,
    pub execs: HashMap<usize, Exec>,
    /// Graph memory of destroyed executable graphs, (device, bytes): the device keeps it until
    /// `cuDeviceGraphMemTrim`, as the H200 does (`tests/gpu/capture_memory.py`).
    pub retained_graph_memory: Vec<(usize, u64)>,
    /// End of all the work queued on each physical device (ns): what a context waits for.
    pub engine_end: [u64; MAX_DEVICES],
    /// End of the work queued on each physical device's default streams (ns): created streams
    /// wait for it, as blocking streams wait for the legacy stream.
    pub default_end: [u64; MAX_DEVICES],
    /// The stretches each physical device is busy with kernels, from now on (disjoint, sorted):
    /// kernels of different streams overlap, and the truth counts the time they occupy together.
    pub occupied: [Vec<(u64, u64)>; MAX_DEVICES],
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| {
    // SAFETY: registers plain functions of this library, which is never unloaded.
    unsafe { libc::pthread_atfork(Some(hold_for_fork), Some(release_after_fork), Some(release_after_fork)) };
    Mutex::new(State::new())
});
static TRUTH: OnceLock<Result<Truth, String>> = OnceLock::new();

thread_local! {
    /// The calling thread's context stack (top = current).
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// The state's lock, held by the forking thread across `fork`.
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, State>>> = const { RefCell::new(None) };
}

/// `fork` takes the state's lock first, so that the child never inherits it held by a thread it
/// does not have (a threaded program that forks while others call the driver).
extern "C" fn hold_for_fork() {
    let guard = lock();
    let _ = HELD_FOR_FORK.try_with(|held| *held.borrow_mut() = Some(guard));
}

/// In the parent and in the child after `fork`: the lock taken before it is released.
extern "C" fn release_after_fork() {
    let _ = HELD_FOR_FORK.try_with(|held| held.borrow_mut().take());
}

/// The process state, whatever a panicking thread left behind.
pub fn lock() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The process state, or `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn initialised() -> CuResult<MutexGuard<'static, State>> {
    crate::checkpoint::wait_while_held();
    let state = lock();
    if state.initialised {
        Ok(state)
    } else {
        Err(CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn ensure_initialised() -> CuResult {
    initialised().map(drop)
}

/// The ground truth of this process: the file at `FAKE_CUDA_TRUTH`, or anonymous memory.
pub fn truth() -> Result<&'static Truth, String> {
    let opened = TRUTH.get_or_init(|| {
        let config = config::get();
        let truth = match &config.truth {
            Some(path) => Truth::open(path).map_err(|e| format!("{}: {e}", path.display())),
            None => Truth::in_memory().map_err(|e| e.to_string()),
        }?;
        for (device, bytes) in config.memory.iter().enumerate() {
            truth.set_capacity_if_unset(device, *bytes);
        }
        Ok(truth)
    });
    opened.as_ref().map_err(Clone::clone)
}

pub fn config() -> &'static Config {
    config::get()
}

pub fn now_ns() -> u64 {
    truth::monotonic_ns()
}

/// Sleeps until `deadline` (ns, `CLOCK_MONOTONIC`). Never call with the state locked.
pub fn sleep_until(deadline: u64) {
    loop {
        let now = now_ns();
        if now >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_nanos(deadline - now));
    }
}

pub fn stack_top() -> Option<usize> {
    STACK.with(|stack| stack.borrow().last().copied())
}

pub fn stack_push(ctx: usize) {
    STACK.with(|stack| stack.borrow_mut().push(ctx));
}

pub fn stack_pop() -> Option<usize> {
    STACK.with(|stack| stack.borrow_mut().pop())
}

/// Replaces the top of the stack (pushes on an empty one); `None` pops.
pub fn stack_set_top(ctx: Option<usize>) {
    STACK.with(|stack| {
        let mut stack = stack.borrow_mut();
        match ctx {
            Some(ctx) => match stack.last_mut() {
                Some(top) => *top = ctx,
                None => stack.push(ctx),
            },
            None => {
                stack.pop();
            }
        }
    });
}

fn own_pid() -> u32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }.unsigned_abs()
}

impl State {
    fn new() -> State {
        let va = (0..MAX_DEVICES)
            .map(|d| {
                let lo = 0x7f00_0000_0000u64 + ((d as u64) << 40);
                VaSpace::new(lo, lo + (1 << 40))
            })
            .collect();
        State {
            initialised: false,
            truth: None,
            slot: 0,
            pid: 0,
            next_handle: FIRST_HANDLE,
            next_capture_id: 1,
            contexts: HashMap::new(),
            primary: Vec::new(),
            allocs: BTreeMap::new(),
            managed: HashMap::new(),
            va,
            reserved_va: VaSpace::new(0x6000_0000_0000, 0x6000_0000_0000 + (1 << 44)),
            pools: HashMap::new(),
            current_pool: Vec::new(),
            default_pool: Vec::new(),
            physical: HashMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            arrays: HashMap::new(),
            externals: HashMap::new(),
            mipmaps: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            streams: HashMap::new(),
            events: HashMap::new(),
            graphs: HashMap::new(),
            nodes: HashMap::new(),
            execs: HashMap::new(),
            retained_graph_memory: Vec::new(),
            engine_end: [0; MAX_DEVICES],
            default_end: [0; MAX_DEVICES],
            occupied: std::array::from_fn(|_| Vec::new()),
        }
    }

    /// `cuInit`: opens the truth, takes a process slot, creates the primary context records.
    pub fn initialise(&mut self) -> CuResult {
        if self.initialised && self.pid == own_pid() {
            return Ok(());
        }
        let config = config();
        if config.visible.is_empty() {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        let truth = truth().map_err(|message| {
            eprintln!("vgpu-fake-driver: cannot open the truth file: {message}");
            CUDA_ERROR_UNKNOWN
        })?;
        self.slot = truth.register().ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        crate::checkpoint::note_own_slot(self.slot);
        self.truth = Some(truth);
        self.pid = own_pid();
        if self.primary.is_empty() {
            for ordinal in 0..config.visible.len() {
                let handle = self.new_handle();
                let phys = config.visible[ordinal];
                let ordinal = ordinal as i32;
                self.contexts.insert(
                    handle,
                    Context {
                        ordinal,
                        phys,
                        primary: true,
                        active: false,
                    },
                );
                self.primary.push(Primary {
                    handle,
                    retain: 0,
                    flags: 0,
                });
                self.current_pool.push(None);
                self.default_pool.push(None);
            }
        }
        self.initialised = true;
        Ok(())
    }

    pub fn new_handle(&mut self) -> usize {
        self.next_handle += 0x10;
        self.next_handle
    }

    pub fn truth(&self) -> CuResult<&'static Truth> {
        self.truth.ok_or(CUDA_ERROR_NOT_INITIALIZED)
    }

    /// The physical index of a CUDA ordinal, or `CUDA_ERROR_INVALID_DEVICE`.
    pub fn device(&self, ordinal: CUdevice) -> CuResult<usize> {
        config().physical(ordinal).ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// Physical capacity in force for a device (the truth file's).
    pub fn capacity(&self, phys: usize) -> u64 {
        match self.truth {
            Some(truth) if truth.device(phys).capacity() > 0 => truth.device(phys).capacity(),
            _ => config().memory.get(phys).copied().unwrap_or(0),
        }
    }

    /// The calling thread's current context, or `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn current(&self) -> CuResult<Current> {
        let ctx = stack_top().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        self.context(ctx)
    }

    /// A live context by handle, or `CUDA_ERROR_INVALID_CONTEXT`.
    pub fn context(&self, ctx: usize) -> CuResult<Current> {
        match self.contexts.get(&ctx) {
            Some(c) if c.active => Ok(Current {
                ctx,
                ordinal: c.ordinal,
                phys: c.phys,
            }),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// Charges physical memory to this process in the truth; `CUDA_ERROR_OUT_OF_MEMORY` if it
    /// does not fit.
    pub fn charge(&mut self, phys: usize, bytes: u64) -> CuResult {
        let truth = self.truth()?;
        if self.pid != own_pid() {
            // A forked child gets its own slot.
            self.slot = truth.register().ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            crate::checkpoint::note_own_slot(self.slot);
            self.pid = own_pid();
        }
        if truth.reserve(self.slot, phys, bytes) {
            Ok(())
        } else {
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }

    pub fn uncharge(&mut self, phys: usize, bytes: u64) {
        if let Some(truth) = self.truth
            && self.pid == own_pid()
        {
            truth.release(self.slot, phys, bytes);
        }
    }

    /// Adds launched work of `ns` to the busy record of a device.
    pub fn add_busy(&self, phys: usize, ns: u64, now: u64) {
        if let Some(truth) = self.truth {
            truth.add_busy(self.slot, phys, ns, now);
        }
    }
}
