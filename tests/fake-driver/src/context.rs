//! Primary and explicit contexts. Each live context (a primary one counted once while retained)
//! charges `FAKE_CUDA_CONTEXT_BYTES` of its device; destroying it frees what was allocated in it.

use std::ffi::{c_int, c_uint};

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put};
use crate::state::{self, Context, State, initialised};

/// The host time a context's creation takes after its memory was taken (outside the state lock).
fn creation_time() {
    let micros = state::config().context_us;
    if micros > 0 {
        std::thread::sleep(std::time::Duration::from_micros(micros));
    }
}

impl State {
    fn create_context(&mut self, dev: CUdevice) -> CuResult<usize> {
        let phys = self.device(dev)?;
        self.charge(phys, state::config().context_bytes)?;
        let handle = self.new_handle();
        self.contexts.insert(
            handle,
            Context {
                ordinal: dev,
                phys,
                primary: false,
                active: true,
            },
        );
        Ok(handle)
    }

    /// Frees everything allocated in `ctx` and its own charge; the record stays for a primary.
    fn tear_down(&mut self, ctx: usize) {
        let Some(context) = self.contexts.get(&ctx) else { return };
        if !context.active {
            return;
        }
        let phys = context.phys;
        let owned: Vec<u64> = self
            .allocs
            .iter()
            .filter(|(_, a)| a.ctx == ctx && a.pool.is_none())
            .map(|(p, _)| *p)
            .collect();
        for ptr in owned {
            self.release_alloc(ptr);
        }
        let arrays: Vec<usize> = self
            .arrays
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(h, _)| *h)
            .collect();
        for handle in arrays {
            if let Some(array) = self.arrays.remove(&handle) {
                self.uncharge(array.phys, array.charge);
            }
        }
        let mipmaps: Vec<usize> = self
            .mipmaps
            .iter()
            .filter(|(_, a)| a.ctx == ctx)
            .map(|(h, _)| *h)
            .collect();
        for handle in mipmaps {
            if let Some(array) = self.mipmaps.remove(&handle) {
                self.uncharge(array.phys, array.charge);
            }
        }
        self.uncharge(phys, state::config().context_bytes);
        if let Some(context) = self.contexts.get_mut(&ctx) {
            context.active = false;
        }
    }

    fn primary_index(&self, dev: CUdevice) -> CuResult<usize> {
        self.device(dev)?;
        usize::try_from(dev)
            .ok()
            .filter(|&i| i < self.primary.len())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    fn retain_primary(&mut self, dev: CUdevice) -> CuResult<usize> {
        let index = self.primary_index(dev)?;
        let handle = self.primary[index].handle;
        if self.primary[index].retain == 0 {
            let phys = self.device(dev)?;
            self.charge(phys, state::config().context_bytes)?;
            if let Some(context) = self.contexts.get_mut(&handle) {
                context.active = true;
            }
        }
        self.primary[index].retain += 1;
        Ok(handle)
    }

    fn release_primary(&mut self, dev: CUdevice) -> CuResult {
        let index = self.primary_index(dev)?;
        let primary = &mut self.primary[index];
        if primary.retain == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        primary.retain -= 1;
        if primary.retain == 0 {
            let handle = primary.handle;
            self.tear_down(handle);
        }
        Ok(())
    }

    fn reset_primary(&mut self, dev: CUdevice) -> CuResult {
        let index = self.primary_index(dev)?;
        let handle = self.primary[index].handle;
        self.tear_down(handle);
        self.primary[index].retain = 0;
        Ok(())
    }

    fn set_primary_flags(&mut self, dev: CUdevice, flags: c_uint, while_active: bool) -> CuResult {
        let index = self.primary_index(dev)?;
        if self.primary[index].retain > 0 && !while_active {
            return Err(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE);
        }
        self.primary[index].flags = flags;
        Ok(())
    }

    fn destroy_context(&mut self, ctx: usize) -> CuResult {
        match self.contexts.get(&ctx) {
            Some(context) if !context.primary && context.active => {}
            _ => return Err(CUDA_ERROR_INVALID_CONTEXT),
        }
        self.tear_down(ctx);
        self.contexts.remove(&ctx);
        if state::stack_top() == Some(ctx) {
            state::stack_pop();
        }
        Ok(())
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    cu(|| {
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = initialised()?.retain_primary(dev)?;
        creation_time();
        // SAFETY: out-pointer from the caller.
        unsafe { put(pctx, handle as CUcontext) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult {
    cu(|| initialised()?.release_primary(dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    cu(|| initialised()?.release_primary(dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult {
    cu(|| initialised()?.reset_primary(dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    cu(|| initialised()?.reset_primary(dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) -> CUresult {
    cu(|| initialised()?.set_primary_flags(dev, flags, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    cu(|| initialised()?.set_primary_flags(dev, flags, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult {
    cu(|| {
        let state = initialised()?;
        let primary = &state.primary[state.primary_index(dev)?];
        if flags.is_null() || active.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: out-pointers from the caller, checked non-null.
        unsafe {
            put(flags, primary.flags)?;
            put(active, c_int::from(primary.retain > 0))
        }
    })
}

fn ctx_create(pctx: *mut CUcontext, dev: CUdevice) -> CuResult {
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let handle = initialised()?.create_context(dev)?;
    creation_time();
    state::stack_push(handle);
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(pctx, handle as CUcontext) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    cu(|| ctx_create(pctx, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    cu(|| ctx_create(pctx, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    _paramsArray: *mut CUexecAffinityParam,
    _numParams: c_int,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    cu(|| ctx_create(pctx, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    _ctxCreateParams: *mut CUctxCreateParams,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    cu(|| ctx_create(pctx, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    cu(|| initialised()?.destroy_context(ctx as usize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    cu(|| initialised()?.destroy_context(ctx as usize))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    cu(|| {
        let state = initialised()?;
        if ctx.is_null() {
            state::stack_set_top(None);
        } else {
            state.context(ctx as usize)?;
            state::stack_set_top(Some(ctx as usize));
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    cu(|| {
        state::ensure_initialised()?;
        let top = state::stack_top().unwrap_or(0);
        // SAFETY: out-pointer from the caller.
        unsafe { put(pctx, top as CUcontext) }
    })
}

fn push_current(ctx: CUcontext) -> CuResult {
    initialised()?.context(ctx as usize)?;
    state::stack_push(ctx as usize);
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent(ctx: CUcontext) -> CUresult {
    cu(|| push_current(ctx))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    cu(|| push_current(ctx))
}

fn pop_current(pctx: *mut CUcontext) -> CuResult {
    state::ensure_initialised()?;
    let top = state::stack_pop().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    if !pctx.is_null() {
        // SAFETY: non-null out-pointer from the caller.
        unsafe { put(pctx, top as CUcontext) }?;
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent(pctx: *mut CUcontext) -> CUresult {
    cu(|| pop_current(pctx))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    cu(|| pop_current(pctx))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    cu(|| {
        let current = initialised()?.current()?;
        // SAFETY: out-pointer from the caller.
        unsafe { put(device, current.ordinal) }
    })
}
