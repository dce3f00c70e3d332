//! Modules, libraries and functions. Any image or file name is accepted (nothing is read) and
//! any function name exists. A function whose name contains `busy_<N>us` (`busy_500us`, also
//! inside a mangled name) keeps the engine busy N microseconds per launch; any other takes 1 us.
//! `busy_<N>us_alt_<M>us` runs N and M microseconds by turns, launch by launch: one function and
//! grid whose time depends on its data, as a real kernel's can.
//! Modules charge no device memory. Loading is lazy, as CUDA's default (`CUDA_MODULE_LOADING=LAZY`):
//! the first launch of each function takes `FAKE_CUDA_MODULE_LOAD_US` of host time inside the
//! launch call ([`crate::engine`]).

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};

use crate::cuda::*;
use crate::ffi::{CuResult, cu, put, string};
use crate::state::{State, initialised};

pub const DEFAULT_DURATION_NS: u64 = 1_000;

pub struct Module {
    /// Function handles by name.
    pub functions: HashMap<String, usize>,
}

pub struct Function {
    pub duration_ns: u64,
    /// `busy_<N>us_alt_<M>us`: M us, run by every other launch.
    pub alternate_ns: Option<u64>,
    /// Launches so far (which of the two durations comes next).
    pub launches: u64,
    /// When its lazy load ends (ns, `CLOCK_MONOTONIC`); `None` until its first launch.
    pub loaded_at: Option<u64>,
}

/// The simulated duration of a kernel, from its name.
pub fn duration_of(name: &str) -> u64 {
    micros_after(name, "busy_").unwrap_or(DEFAULT_DURATION_NS)
}

/// The other duration of a `busy_<N>us_alt_<M>us` kernel.
pub fn alternate_of(name: &str) -> Option<u64> {
    micros_after(name, "_alt_")
}

/// `<digits>us` right after the first `marker` followed by them, in nanoseconds.
fn micros_after(name: &str, marker: &str) -> Option<u64> {
    let mut rest = name;
    while let Some(at) = rest.find(marker) {
        let after = &rest[at + marker.len()..];
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0
            && after[digits..].starts_with("us")
            && let Ok(us) = after[..digits].parse::<u64>()
        {
            return Some(us.saturating_mul(1_000));
        }
        rest = after;
    }
    None
}

impl Function {
    /// The duration of the next launch.
    pub fn next_duration(&mut self) -> u64 {
        let odd = self.launches % 2 == 1;
        self.launches = self.launches.wrapping_add(1);
        match self.alternate_ns {
            Some(alternate) if odd => alternate,
            _ => self.duration_ns,
        }
    }
}

impl State {
    fn load_module(&mut self, needs_context: bool) -> CuResult<usize> {
        if needs_context {
            self.current()?;
        }
        let handle = self.new_handle();
        self.modules.insert(
            handle,
            Module {
                functions: HashMap::new(),
            },
        );
        Ok(handle)
    }

    fn unload_module(&mut self, handle: usize) -> CuResult {
        let module = self.modules.remove(&handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for function in module.functions.values() {
            self.functions.remove(function);
        }
        Ok(())
    }

    fn function(&mut self, module: usize, name: &str) -> CuResult<usize> {
        if let Some(&handle) = self
            .modules
            .get(&module)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?
            .functions
            .get(name)
        {
            return Ok(handle);
        }
        let handle = self.new_handle();
        self.functions.insert(
            handle,
            Function {
                duration_ns: duration_of(name),
                alternate_ns: alternate_of(name),
                launches: 0,
                loaded_at: None,
            },
        );
        if let Some(m) = self.modules.get_mut(&module) {
            m.functions.insert(name.to_string(), handle);
        }
        Ok(handle)
    }
}

fn load(module: *mut CUmodule, source: *const c_void, needs_context: bool) -> CuResult {
    if module.is_null() || source.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let handle = initialised()?.load_module(needs_context)?;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(module, handle as CUmodule) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> CUresult {
    cu(|| load(module, fname.cast(), true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    cu(|| load(module, image, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    _numOptions: c_uint,
    _options: *mut CUjit_option,
    _optionValues: *mut *mut c_void,
) -> CUresult {
    cu(|| load(module, image, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadFatBinary(module: *mut CUmodule, fatCubin: *const c_void) -> CUresult {
    cu(|| load(module, fatCubin, true))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(hmod: CUmodule) -> CUresult {
    cu(|| initialised()?.unload_module(hmod as usize))
}

fn get_function(hfunc: *mut CUfunction, module: usize, name: *const c_char) -> CuResult {
    if hfunc.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: a NUL-terminated name from the caller (null is rejected).
    let name = unsafe { string(name) }?;
    let handle = initialised()?.function(module, &name)?;
    // SAFETY: out-pointer from the caller, checked non-null.
    unsafe { put(hfunc, handle as CUfunction) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(hfunc: *mut CUfunction, hmod: CUmodule, name: *const c_char) -> CUresult {
    cu(|| get_function(hfunc, hmod as usize, name))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut CUlibrary,
    code: *const c_void,
    _jitOptions: *mut CUjit_option,
    _jitOptionsValues: *mut *mut c_void,
    _numJitOptions: c_uint,
    _libraryOptions: *mut CUlibraryOption,
    _libraryOptionValues: *mut *mut c_void,
    _numLibraryOptions: c_uint,
) -> CUresult {
    cu(|| load(library.cast(), code, false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadFromFile(
    library: *mut CUlibrary,
    fileName: *const c_char,
    _jitOptions: *mut CUjit_option,
    _jitOptionsValues: *mut *mut c_void,
    _numJitOptions: c_uint,
    _libraryOptions: *mut CUlibraryOption,
    _libraryOptionValues: *mut *mut c_void,
    _numLibraryOptions: c_uint,
) -> CUresult {
    cu(|| load(library.cast(), fileName.cast(), false))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryUnload(library: CUlibrary) -> CUresult {
    cu(|| initialised()?.unload_module(library as usize))
}

/// A library's module is the library itself.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetModule(pMod: *mut CUmodule, library: CUlibrary) -> CUresult {
    cu(|| {
        if !initialised()?.modules.contains_key(&(library as usize)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        // SAFETY: out-pointer from the caller.
        unsafe { put(pMod, library as CUmodule) }
    })
}

/// Kernels and functions share handles: a `CUkernel` launches as a `CUfunction`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetKernel(
    pKernel: *mut CUkernel,
    library: CUlibrary,
    name: *const c_char,
) -> CUresult {
    cu(|| get_function(pKernel.cast(), library as usize, name))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetFunction(pFunc: *mut CUfunction, kernel: CUkernel) -> CUresult {
    cu(|| {
        if !initialised()?.functions.contains_key(&(kernel as usize)) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        // SAFETY: out-pointer from the caller.
        unsafe { put(pFunc, kernel as CUfunction) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_from_names() {
        assert_eq!(duration_of("busy_500us"), 500_000);
        assert_eq!(duration_of("_Z10busy_1000usPf"), 1_000_000);
        assert_eq!(duration_of("busy_x_busy_7us"), 7_000);
        assert_eq!(duration_of("busy_us"), DEFAULT_DURATION_NS);
        assert_eq!(duration_of("busy_12ms"), DEFAULT_DURATION_NS);
        assert_eq!(duration_of("vector_add"), DEFAULT_DURATION_NS);
        assert_eq!(duration_of("busy_99999999999999999999us"), DEFAULT_DURATION_NS);
        assert_eq!(alternate_of("busy_500us"), None);
        assert_eq!(duration_of("busy_100us_alt_300us_2"), 100_000);
        assert_eq!(alternate_of("busy_100us_alt_300us_2"), Some(300_000));
    }

    #[test]
    fn an_alternating_kernel_runs_its_two_durations_by_turns() {
        let mut function = Function {
            duration_ns: 100,
            alternate_ns: Some(300),
            launches: 0,
            loaded_at: None,
        };
        let durations: Vec<u64> = (0..4).map(|_| function.next_duration()).collect();
        assert_eq!(durations, [100, 300, 100, 300]);
    }
}
