//! The foundation: every entry point exported, the three ways of reaching the driver land in our
//! wrappers, cuGetProcAddress answers as the driver chose, other interposers keep working, and
//! failures become error codes.

use std::collections::BTreeSet;
use std::process::Command;

use vgpu_integration::{Run, ScratchDir, c_program, hook_library};

const CUDA_SUCCESS: &str = "0";
const CUDA_ERROR_INVALID_VALUE: &str = "1";
const CUDA_ERROR_NOT_FOUND: &str = "500";
const CUDA_ERROR_UNKNOWN: &str = "999";
const NVML_ERROR_FUNCTION_NOT_FOUND: &str = "13";

/// What the headers declare, as this crate's build script read them with the generator.
struct Declared {
    cuda_version: u32,
    /// (library key, declaring header, name) of every entry point the hook exports.
    functions: Vec<(String, String, String)>,
    /// Every base name with versioned variants (`cuMemAlloc` for `cuMemAlloc_v2`).
    variant_bases: Vec<String>,
}

fn declared() -> Declared {
    let mut declared = Declared {
        cuda_version: 0,
        functions: Vec::new(),
        variant_bases: Vec::new(),
    };
    for line in include_str!(concat!(env!("OUT_DIR"), "/declared.txt")).lines() {
        match line.split('\t').collect::<Vec<_>>()[..] {
            ["cuda_version", version] => declared.cuda_version = version.parse().expect("a CUDA version"),
            ["function", library, header, name] => {
                declared
                    .functions
                    .push((library.to_string(), header.to_string(), name.to_string()))
            }
            ["variant", base] => declared.variant_bases.push(base.to_string()),
            _ => panic!("unexpected line in declared.txt: {line:?}"),
        }
    }
    declared
}

fn stderr_lines(output: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn exports_exactly_the_header_functions_dlsym_and_the_vulkan_layer_entry() {
    let declared = declared();
    // The Vulkan layer's one entry point: only the loader calls it, so a preloaded library
    // interposes on nothing of Vulkan's (never vkGetInstanceProcAddr or vkGetDeviceProcAddr).
    let expected: BTreeSet<String> = declared
        .functions
        .iter()
        .map(|(_, _, name)| name.clone())
        .chain(["dlsym", "vkNegotiateLoaderLayerInterfaceVersion"].map(String::from))
        .collect();
    let output = vgpu_test_spawn::output_started(Command::new("nm").args(["-D", "--defined-only"]).arg(hook_library()))
        .expect("run nm");
    assert!(output.status.success());
    let exported: BTreeSet<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .map(|name| name.split('@').next().unwrap_or(name).to_string())
        .collect();
    let extra: Vec<_> = exported.difference(&expected).collect();
    let missing: Vec<_> = expected.difference(&exported).collect();
    assert!(extra.is_empty(), "exported but not in the headers: {extra:?}");
    assert!(missing.is_empty(), "in the headers but not exported: {missing:?}");
    let cuda = declared
        .functions
        .iter()
        .filter(|(library, _, _)| library == vgpu_codegen::Library::Cuda.key())
        .count();
    let nvml = declared.functions.len() - cuda;
    assert_eq!(exported.len(), cuda + nvml + 2);
    // The counts each supported release's headers declare (cuda.h, nvml.h), as the snapshots show.
    let counts = match declared.cuda_version {
        12090 => Some((616, 387)),
        13000 => Some((634, 398)),
        13050 => Some((685, 436)),
        _ => None,
    };
    if let Some(counts) = counts {
        let from_cuda_h = declared
            .functions
            .iter()
            .filter(|(_, header, _)| header == "cuda.h")
            .count();
        assert_eq!(
            (from_cuda_h, nvml),
            counts,
            "driver and NVML functions of the CUDA {} headers",
            declared.cuda_version
        );
        assert!(cuda > from_cuda_h, "the interop headers' entry points are exported too");
    }
}

#[test]
fn three_ways_to_the_driver_land_in_the_hook() {
    let program = c_program("reach", false);
    let native = Run::new(&program).lines();
    let hooked = Run::new(&program).hooked().lines();
    assert_eq!(native.len(), 3, "{native:?}");
    assert_eq!(hooked.len(), 3, "{hooked:?}");
    for (native, hooked) in native.iter().zip(&hooked) {
        let n: Vec<&str> = native.split(' ').collect();
        let h: Vec<&str> = hooked.split(' ').collect();
        assert_eq!(n[0], h[0]);
        assert_eq!(n[1], CUDA_SUCCESS, "{native}");
        assert_eq!(h[1], CUDA_SUCCESS, "{hooked}");
        assert!(n[2].starts_with("libcuda.so"), "{native}");
        assert_eq!(h[2], "libvgpu.so", "{hooked}: the call did not go through the hook");
        assert_eq!(h[3], "cuDeviceGetCount", "{hooked}");
    }
}

#[test]
fn proc_address_returns_our_wrapper_for_the_drivers_choice() {
    let declared = declared();
    let names: BTreeSet<&str> = declared.variant_bases.iter().map(String::as_str).collect();
    let mut input: Vec<&str> = names.into_iter().collect();
    input.push("cuNoSuchFunction");
    let expected_answers = input.len() * 5 * 3;
    let input = input.join("\n");
    let program = c_program("procaddr", false);
    let native = Run::new(&program).stdin(input.clone()).lines();
    let hooked = Run::new(&program).hooked().stdin(input).lines();
    assert_eq!(native.len(), hooked.len());
    assert_eq!(native.len(), expected_answers, "one answer per name, version and flag");
    let mut successes = 0;
    for (native, hooked) in native.iter().zip(&hooked) {
        // name version flags status found file symbol
        let n: Vec<&str> = native.split(' ').collect();
        let h: Vec<&str> = hooked.split(' ').collect();
        assert_eq!(
            n[..5],
            h[..5],
            "status differs:\n  driver: {native}\n  hooked: {hooked}"
        );
        assert_eq!(n[6], h[6], "variant differs:\n  driver: {native}\n  hooked: {hooked}");
        if n[3] == CUDA_SUCCESS {
            successes += 1;
            assert!(n[5].starts_with("libcuda.so"), "{native}");
            assert_eq!(h[5], "libvgpu.so", "{hooked}: answer not mapped to our wrapper");
        } else {
            assert_eq!(h[5], "-", "{hooked}: a failed lookup returned a pointer");
        }
    }
    assert!(successes > 2000, "only {successes} successful lookups");
    // The per-thread flag really picks other variants in the fake, so the comparison saw them.
    assert!(
        hooked
            .iter()
            .any(|line| line.starts_with("cuLaunchKernel 13000 2 0 0 libvgpu.so cuLaunchKernel_ptsz"))
    );
    assert!(
        hooked
            .iter()
            .any(|line| line.starts_with("cuMemAlloc 13000 0 0 0 libvgpu.so cuMemAlloc_v2"))
    );
}

#[test]
fn rtld_next_stays_relative_to_its_caller() {
    let wrapper = c_program("wrapgetpid", true);
    let program = c_program("interposers", false);
    let hook = hook_library();
    for order in [[&hook, &wrapper], [&wrapper, &hook]] {
        let lines = Run::new(&program)
            .preload(&[order[0].as_path(), order[1].as_path()])
            .lines();
        assert!(lines[0].starts_with("getpid ok "), "{order:?}: {lines:?}");
        assert_eq!(lines[1], "cuda 0 1", "{order:?}: {lines:?}");
    }
}

#[test]
fn missing_symbols_return_not_found_and_log_once() {
    let program = c_program("calls", false);
    let output = Run::new(&program)
        .hooked()
        .args(["init", "missing-cuda", "missing-cuda", "missing-nvml", "count"])
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "init 0".to_string(),
            format!("missing-cuda {CUDA_ERROR_NOT_FOUND}"),
            format!("missing-cuda {CUDA_ERROR_NOT_FOUND}"),
            format!("missing-nvml {NVML_ERROR_FUNCTION_NOT_FOUND}"),
            "count 0 1".to_string(),
        ]
    );
    let errors = stderr_lines(&output);
    let about_cuda = errors
        .iter()
        .filter(|l| l.contains("cuDeviceGetNvSciSyncAttributes"))
        .count();
    assert_eq!(about_cuda, 1, "{errors:?}");
    assert_eq!(
        errors
            .iter()
            .filter(|l| l.contains("nvmlDeviceGetNvLinkRemotePciInfo_v2"))
            .count(),
        1,
        "{errors:?}"
    );
}

/// The headers may be newer than the driver (the H200's 580 driver is CUDA 13.0; the library is
/// built from 13.5): every function the driver lacks is still exported, and answers not-found
/// when called, with one error line per function. With the default fake that is its
/// `NOT_EXPORTED` pair; with `VGPU_TEST_FAKE_DRIVER` set to a fake built from older headers
/// (scripts/test-versions.sh), every function newer than it.
#[test]
fn functions_the_driver_lacks_answer_not_found_with_one_line_each() {
    let declared = declared();
    let driver = vgpu_integration::fake_driver_dir().join("libcuda.so.1");
    let driver_path = std::ffi::CString::new(driver.display().to_string()).expect("path");
    // SAFETY: a NUL-terminated path; the library is the fake driver, which runs no constructor
    // that matters here, and stays loaded for the test process's life.
    let handle = unsafe { libc::dlopen(driver_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "cannot load {}", driver.display());
    let lacking: Vec<(String, &str)> = declared
        .functions
        .iter()
        .filter(|(_, _, name)| {
            let name = std::ffi::CString::new(name.as_str()).expect("name");
            // SAFETY: a valid handle and a NUL-terminated name.
            unsafe { libc::dlsym(handle, name.as_ptr()) }.is_null()
        })
        .map(|(library, _, name)| {
            let expected = if library == vgpu_codegen::Library::Cuda.key() {
                CUDA_ERROR_NOT_FOUND
            } else {
                NVML_ERROR_FUNCTION_NOT_FOUND
            };
            (name.clone(), expected)
        })
        .collect();
    assert!(
        lacking.iter().any(|(name, _)| name == "cuDeviceGetNvSciSyncAttributes"),
        "{lacking:?}"
    );
    // Each called twice.
    let calls: Vec<String> = lacking
        .iter()
        .flat_map(|(name, _)| [format!("call={name}"), format!("call={name}")])
        .collect();
    let output = Run::new(&c_program("calls", false))
        .hooked()
        .args(std::iter::once("init".to_string()).chain(calls))
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let answers: Vec<&str> = stdout.lines().skip(1).collect();
    assert_eq!(answers.len(), lacking.len() * 2, "{stdout}");
    for (answer, (name, expected)) in answers.chunks(2).zip(&lacking) {
        for line in answer {
            assert_eq!(*line, format!("call {name} {expected}"), "{stdout}");
        }
    }
    let errors = stderr_lines(&output);
    for (name, _) in &lacking {
        let said = errors
            .iter()
            .filter(|line| line.contains(&format!(" {name} is missing from")))
            .count();
        assert_eq!(said, 1, "{name}: {errors:?}");
    }
}

/// A driver newer than the headers answers with functions the hook does not export: each is
/// reported once, at warning level (the default), naming it and saying the library is older.
/// The fake exports `cuFakeNewerDriverFunction` for this, a name no header declares.
#[test]
fn a_newer_drivers_function_is_reported_once_per_function() {
    let warnings = |output: &std::process::Output, via: &str| -> Vec<String> {
        stderr_lines(output)
            .into_iter()
            .filter(|line| line.contains(&format!("{via} answered with the driver's cuFakeNewerDriverFunction")))
            .collect()
    };
    // Through cuGetProcAddress: 5 versions x 3 flags, asked twice; the answer is the driver's.
    let output = Run::new(&c_program("procaddr", false))
        .hooked()
        .stdin("cuFakeNewerDriverFunction\ncuFakeNewerDriverFunction\n")
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.lines().count(), 30, "{stdout}");
    for line in stdout.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields[3], CUDA_SUCCESS, "{line}");
        assert!(
            fields[5].starts_with("libcuda.so"),
            "{line}: not the driver's own function"
        );
    }
    let lines = warnings(&output, "cuGetProcAddress");
    assert_eq!(lines.len(), 1, "{:?}", stderr_lines(&output));
    assert!(
        lines[0].contains(" WARN ") && lines[0].contains("is older than the driver"),
        "{}",
        lines[0]
    );
    // Through dlsym on the driver's handle, twice.
    let output = Run::new(&c_program("calls", false))
        .hooked()
        .args(["newer", "newer", "init", "count"])
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.starts_with("newer 0 libcuda.so"), "{stdout}");
    assert_eq!(warnings(&output, "dlsym").len(), 1, "{:?}", stderr_lines(&output));
    // Names the hook exports, and other libraries' cu* names, are not reported.
    let output = Run::new(&c_program("calls", false))
        .hooked()
        .args(["init", "count", "missing-cuda"])
        .output();
    assert!(
        !stderr_lines(&output)
            .iter()
            .any(|line| line.contains("older than the driver")),
        "{:?}",
        stderr_lines(&output)
    );
}

/// A private entry point that cuda-api.toml names as undeclared (NVML's export table, which
/// nvidia-smi asks for at every start) reaches the application unhooked without the warning that
/// the library is older than the driver, which every nvidia-smi in a container would print; at
/// debug level it is noted once.
#[test]
fn a_private_entry_point_in_the_table_is_not_warned_about() {
    let program = c_program("calls", false);
    let output = Run::new(&program)
        .hooked()
        .args(["private-nvml", "private-nvml"])
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The fake's own function answered (NVML_ERROR_NOT_SUPPORTED), twice.
    assert_eq!(stdout, "private-nvml 3\nprivate-nvml 3\n");
    assert_eq!(
        stderr_lines(&output),
        Vec::<String>::new(),
        "nothing at the default level"
    );
    let output = Run::new(&program)
        .hooked()
        .env("LIBCUDA_LOG_LEVEL", "4")
        .args(["private-nvml", "private-nvml"])
        .output();
    let noted: Vec<String> = stderr_lines(&output)
        .into_iter()
        .filter(|line| line.contains("nvmlInternalGetExportTable"))
        .collect();
    assert_eq!(noted.len(), 1, "{:?}", stderr_lines(&output));
    assert!(
        noted[0].contains(" DEBUG ") && noted[0].contains("undeclared"),
        "{}",
        noted[0]
    );
}
#[test]
fn injected_panic_becomes_an_error_code() {
    let program = c_program("calls", false);
    // A handler (cuDeviceTotalMem_v2 is overridden) and a passthrough function's first
    // resolution (cuDriverGetVersion): both panics become CUDA_ERROR_UNKNOWN and the process goes on.
    for (target, first, panicked) in [
        (
            "cuDeviceTotalMem_v2",
            "totalmem",
            format!("totalmem {CUDA_ERROR_UNKNOWN} 0"),
        ),
        (
            "cuDriverGetVersion",
            "version",
            format!("version {CUDA_ERROR_UNKNOWN} -1"),
        ),
    ] {
        let output = Run::new(&program)
            .preload(&[hook_library().as_path()])
            .env("VGPU_FAULT_PANIC", target)
            .args(["init", first, first, "count"])
            .output();
        assert!(output.status.success(), "{output:?}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines,
            ["init 0", panicked.as_str(), panicked.as_str(), "count 0 1"],
            "{target}"
        );
        let errors = stderr_lines(&output);
        assert_eq!(errors.len(), 2, "one line per panic: {errors:?}");
        assert!(
            errors.iter().all(|l| l.contains(target) && l.contains("ERROR")),
            "{errors:?}"
        );
    }
}

#[test]
fn malformed_limit_fails_cuinit_with_one_line() {
    let program = c_program("calls", false);
    let output = Run::new(&program)
        .hooked()
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1x")
        .args(["init"])
        .output();
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("init {CUDA_ERROR_INVALID_VALUE}")
    );
    let errors = stderr_lines(&output);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].contains("CUDA_DEVICE_MEMORY_LIMIT") && errors[0].contains("1x"),
        "{errors:?}"
    );
    let good = Run::new(&program)
        .hooked()
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1GiB")
        .args(["init"])
        .output();
    assert_eq!(String::from_utf8_lossy(&good.stdout).trim(), "init 0");
}

#[test]
fn strict_configuration_fails_cuinit_with_one_short_line() {
    let program = c_program("calls", false);
    let scratch = ScratchDir::new("strict-config");
    // A relative path that names a file in the scratch folder from any working directory (".."
    // stops at "/"), so a library that accepted it would not write into the test's folder.
    let relative = format!(
        "{}{}",
        "../".repeat(64),
        scratch.join("region").display().to_string().trim_start_matches('/')
    );
    let long = format!("1{}", "x".repeat(99_999));
    let refused = [
        ("GPU_CORE_UTILIZATION_POLICY", "forced"),
        ("GPU_CORE_UTILIZATION_POLICY", "on"),
        ("VGPU_COMPUTE_PROFILE", "none"),
        ("CUDA_DEVICE_MEMORY_LIMIT_16", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_99", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_00", "1g"),
        ("CUDA_DEVICE_SM_LIMIT_16", "50"),
        ("CUDA_DEVICE_SM_LIMIT_01", "50"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", relative.as_str()),
        ("CUDA_DEVICE_MEMORY_LIMIT", long.as_str()),
    ];
    // `init` with one variable set, in a region folder of this test's.
    let init_with = |variable: &str, value: &str| {
        Run::new(&program)
            .hooked()
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", scratch.join("region"))
            .env(variable, value)
            .args(["init"])
            .output()
    };
    for (variable, value) in refused {
        let output = init_with(variable, value);
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            format!("init {CUDA_ERROR_INVALID_VALUE}"),
            "{variable}={:.80}",
            value
        );
        let errors = stderr_lines(&output);
        assert_eq!(errors.len(), 1, "{variable}: {:.2000}", errors.join("\n"));
        assert!(
            errors[0].contains("ERROR") && errors[0].contains(&format!("invalid {variable}=")),
            "{:.2000}",
            errors[0]
        );
        assert!(errors[0].len() < 512, "{variable}: a line of {} bytes", errors[0].len());
    }
    assert!(
        !scratch.join("region").exists(),
        "a refused configuration created the region"
    );
    // HAMi's policy values, in either case, and the last device.
    for (variable, value) in [
        ("GPU_CORE_UTILIZATION_POLICY", "FORCE"),
        ("GPU_CORE_UTILIZATION_POLICY", "force"),
        ("GPU_CORE_UTILIZATION_POLICY", "DISABLE"),
        ("GPU_CORE_UTILIZATION_POLICY", "disable"),
        ("GPU_CORE_UTILIZATION_POLICY", "DEFAULT"),
        ("GPU_CORE_UTILIZATION_POLICY", "default"),
        ("GPU_CORE_UTILIZATION_POLICY", ""),
        ("CUDA_DEVICE_MEMORY_LIMIT_15", "1g"),
        ("CUDA_DEVICE_SM_LIMIT_15", "50"),
        ("CUDA_DEVICE_MEMORY_LIMIT_16", ""),
    ] {
        let output = init_with(variable, value);
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            "init 0",
            "{variable}={value}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.stderr.is_empty(), "{}", String::from_utf8_lossy(&output.stderr));
    }
}

/// The number before "similar lines suppressed" in a line, if any.
fn suppressed_count(line: &str) -> Option<u64> {
    let before = line.split(" similar lines suppressed").next()?;
    (before.len() < line.len()).then_some(())?;
    before.rsplit(['(', ' ']).next()?.parse().ok()
}

#[test]
fn a_flood_of_failing_calls_gives_few_lines_and_counts_the_rest() {
    let program = c_program("calls", false);
    // cuInit refused for a malformed limit writes an error line each time it is called.
    let flood = |what: &str| {
        let output = Run::new(&program)
            .hooked()
            .env("CUDA_DEVICE_MEMORY_LIMIT", "1x")
            .args([what])
            .output();
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let fields: Vec<&str> = stdout.split_whitespace().collect();
        assert_eq!(fields.get(1), Some(&CUDA_ERROR_INVALID_VALUE), "{stdout}");
        let calls: u64 = fields.get(2).and_then(|n| n.parse().ok()).unwrap_or(0);
        (calls, output.stderr)
    };
    let (calls, stderr) = flood("initloop=100000");
    assert_eq!(calls, 100_000);
    assert!(
        stderr.len() < 4096,
        "{} bytes of stderr for {calls} failing calls",
        stderr.len()
    );
    let lines: Vec<&str> = std::str::from_utf8(&stderr).unwrap_or_default().lines().collect();
    assert_eq!(lines.len(), 5, "the first few lines, then silence: {lines:?}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("ERROR") && l.contains("CUDA_DEVICE_MEMORY_LIMIT"))
    );
    assert!(
        lines[4].contains("suppressed"),
        "the last one says what follows: {}",
        lines[4]
    );

    // Past the interval (10 s) one more line, with the count of those suppressed before it.
    let (calls, stderr) = flood("initfor=11000");
    assert!(
        stderr.len() < 4096,
        "{} bytes of stderr for {calls} failing calls",
        stderr.len()
    );
    let lines: Vec<&str> = std::str::from_utf8(&stderr).unwrap_or_default().lines().collect();
    assert_eq!(lines.len(), 6, "{lines:?}");
    let suppressed = suppressed_count(lines[5]).unwrap_or_else(|| panic!("no count in {}", lines[5]));
    assert!(
        suppressed > 0 && suppressed + 6 <= calls,
        "{suppressed} of {calls}: {}",
        lines[5]
    );
}

#[test]
fn quiet_by_default_and_stdout_untouched() {
    let program = c_program("calls", false);
    let native = Run::new(&program)
        .args(["init", "count", "version", "nvml", "exporttable"])
        .output();
    let hooked = Run::new(&program)
        .hooked()
        .args(["init", "count", "version", "nvml", "exporttable"])
        .output();
    assert_eq!(
        String::from_utf8_lossy(&native.stdout),
        String::from_utf8_lossy(&hooked.stdout)
    );
    // cuGetExportTable passes through: the table is the driver's own.
    assert!(
        String::from_utf8_lossy(&hooked.stdout).contains("exporttable 0 libcuda.so"),
        "{hooked:?}"
    );
    assert!(
        hooked.stderr.is_empty(),
        "stderr at the default level: {}",
        String::from_utf8_lossy(&hooked.stderr)
    );
    // Building the cuGetProcAddress map probes every export, including the ones the fake lacks:
    // a function nobody calls is not an error.
    let reach = Run::new(&c_program("reach", false))
        .hooked()
        .args(["procaddress"])
        .output();
    assert!(
        reach.stderr.is_empty(),
        "stderr at the default level: {}",
        String::from_utf8_lossy(&reach.stderr)
    );
}

#[test]
fn debug_level_logs_proc_address_answers_with_pid() {
    let program = c_program("reach", false);
    let output = Run::new(&program)
        .hooked()
        .env("LIBCUDA_LOG_LEVEL", "4")
        .args(["procaddress"])
        .output();
    let errors = stderr_lines(&output);
    let answer = errors
        .iter()
        .find(|l| l.contains("cuGetProcAddress(cuDeviceGetCount, 13000, 0x0) -> cuDeviceGetCount"));
    let answer = answer.unwrap_or_else(|| panic!("no debug line for the lookup: {errors:?}"));
    assert!(answer.starts_with("[vgpu pid ") && answer.contains("DEBUG"), "{answer}");
    let pid = answer.trim_start_matches("[vgpu pid ").split(']').next().unwrap_or("");
    assert!(pid.parse::<u32>().is_ok(), "{answer}");
}

#[test]
fn works_in_a_forked_child() {
    let program = c_program("calls", false);
    let output = Run::new(&program)
        .hooked()
        .env("LIBCUDA_LOG_LEVEL", "4")
        .args(["init", "fork"])
        .output();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert_eq!(lines[0], "init 0");
    let child: Vec<&str> = lines[1].split(' ').collect();
    assert_eq!((child[0], child[2], child[3]), ("child", "0", "1"), "{lines:?}");
    assert_eq!(lines[2], "fork 0");
}
