//! `vgpu-smi`: shows vgpu's shared regions (memory and compute per device and per process),
//! serves them as Prometheus metrics, plots recordings, and suspends or resumes processes.
//! `vgpu-smi --help` lists the commands; `docs/monitoring.md` documents them.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Parser as _;
use vgpu_monitor::cli::{Cli, Command, ControlArgs, PlotArgs, Regions, ServeArgs, SetArgs, ShowArgs, SuspendArgs};
use vgpu_monitor::control::{self, Target};
use vgpu_monitor::read::{DEFAULT_REGION_PATH, REGION_PATH_VARIABLE, discover, read_region, shown};
use vgpu_monitor::release::{self, Checkpoint};
use vgpu_monitor::report::{Report, build_report, now_unix_ms, process_is_alive};
use vgpu_monitor::{limits, metrics, plot, table};

fn main() -> ExitCode {
    // A bad command line ends here: clap names the argument and exits with status 2 (0 for
    // --help and --version).
    let result = match Cli::parse().into_command() {
        Command::Show(arguments) => show(&arguments),
        Command::Serve(arguments) => serve(&arguments),
        Command::Suspend(arguments) if arguments.release => release(&arguments),
        Command::Suspend(arguments) => suspend_or_resume(&arguments.control, true),
        Command::Resume(arguments) => suspend_or_resume(&arguments, false),
        Command::Plot(arguments) => plot_command(&arguments),
        Command::Set(arguments) => set_command(&arguments),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(problem) => {
            eprintln!("vgpu-smi: {problem}");
            ExitCode::from(1)
        }
    }
}

/// The `--region` arguments, or the library's region path.
fn region_arguments(regions: &Regions) -> Vec<PathBuf> {
    if !regions.paths.is_empty() {
        return regions.paths.clone();
    }
    let path = std::env::var_os(REGION_PATH_VARIABLE)
        .filter(|value| !value.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_REGION_PATH), PathBuf::from);
    vec![path]
}

/// Reads every region named by the arguments now. A path that cannot be listed is reported as
/// an unreadable region, so it shows up in every output.
fn sample(regions: &Regions, now: Option<u64>) -> Report {
    let mut reads = Vec::new();
    for argument in region_arguments(regions) {
        match discover(&argument) {
            Ok(paths) => reads.extend(paths.iter().map(|path| read_region(path))),
            Err(problem) => reads.push(vgpu_monitor::RegionRead {
                path: argument.clone(),
                result: Err(problem),
            }),
        }
    }
    build_report(&reads, now.unwrap_or_else(now_unix_ms), process_is_alive)
}

fn all_readable(report: &Report) -> bool {
    report.regions.iter().all(|region| region.error.is_none())
}

fn show(options: &ShowArgs) -> Result<bool, String> {
    let mut record = match &options.record {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|error| format!("{}: cannot open the record: {error}", shown(path)))?,
        ),
        None => None,
    };
    let mut samples = 0u64;
    loop {
        let report = sample(&options.regions, options.now);
        samples += 1;
        if let Some(file) = record.as_mut() {
            let line = serde_json::to_string(&report).map_err(|error| error.to_string())?;
            writeln!(file, "{line}").map_err(|error| format!("writing the record: {error}"))?;
        }
        let mut stdout = std::io::stdout().lock();
        let written = match (options.json, options.watch) {
            (true, Some(_)) => {
                let line = serde_json::to_string(&report).map_err(|error| error.to_string())?;
                writeln!(stdout, "{line}")
            }
            (true, None) => {
                let text = serde_json::to_string_pretty(&report).map_err(|error| error.to_string())?;
                writeln!(stdout, "{text}")
            }
            (false, Some(interval)) => write!(
                stdout,
                "\x1b[H\x1b[2J{}  (every {}s, sample {samples})\n\n{}",
                format_time(report.time_unix_ms),
                interval.as_secs_f64(),
                table::render(&report)
            ),
            (false, None) => write!(stdout, "{}", table::render(&report)),
        };
        // A closed pipe (`vgpu-smi --watch | head`) ends the program quietly.
        if written.and_then(|()| stdout.flush()).is_err() {
            return Ok(true);
        }
        drop(stdout);
        let Some(interval) = options.watch else {
            return Ok(all_readable(&report));
        };
        if options.count.is_some_and(|count| samples >= count) {
            return Ok(all_readable(&report));
        }
        std::thread::sleep(interval);
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` from milliseconds since the epoch (RFC 3339, written for people).
fn format_time(unix_ms: u64) -> String {
    // humantime writes years up to 9999; a later `--now` is shown as the number it is.
    const LAST_SECOND_OF_9999: u64 = 253_402_300_799;
    let seconds = unix_ms / 1000;
    if seconds > LAST_SECOND_OF_9999 {
        return format!("{unix_ms} ms since 1970");
    }
    humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds))
        .to_string()
        .replacen('T', " ", 1)
        .replacen('Z', " UTC", 1)
}

fn serve(options: &ServeArgs) -> Result<bool, String> {
    let regions = options.regions.clone();
    let metrics: vgpu_monitor::serve::Metrics =
        std::sync::Arc::new(move || metrics::encode_report(&sample(&regions, None)).map_err(|error| error.to_string()));
    vgpu_monitor::serve::serve(&options.listen, metrics)?;
    Ok(true)
}

/// The region files a control command acts on; an argument that names none is said, and sets
/// `failed`.
fn control_paths(regions: &Regions, failed: &mut bool) -> Vec<PathBuf> {
    let mut all = Vec::new();
    for argument in region_arguments(regions) {
        match discover(&argument) {
            Ok(paths) => all.extend(paths),
            Err(problem) => {
                eprintln!("vgpu-smi: {}: {problem}", shown(&argument));
                *failed = true;
            }
        }
    }
    all
}

fn suspend_or_resume(options: &ControlArgs, suspend: bool) -> Result<bool, String> {
    let target = options.pid.map_or(Target::All, Target::Pid);
    let verb = if suspend { "suspended" } else { "resumed" };
    let mut changed_any = false;
    let mut failed = false;
    for path in control_paths(&options.regions, &mut failed) {
        if !suspend && release::has_released(&path, target) {
            // Released processes are restored before they run again.
            let driver = match Checkpoint::load() {
                Ok(driver) => Some(driver),
                Err(problem) => {
                    eprintln!("vgpu-smi: {problem}: released processes stay released");
                    None
                }
            };
            match release::resume(&path, target, driver.as_ref()) {
                Ok(outcome) => {
                    changed_any |= outcome.done > 0 || outcome.failed;
                    failed |= outcome.failed;
                }
                Err(problem) => {
                    eprintln!("vgpu-smi: {problem}");
                    failed = true;
                }
            }
            continue;
        }
        match control::set_suspended(&path, target, suspend) {
            Ok(changed) => {
                for slot in &changed {
                    println!("{verb} pid {} (slot {}) in {}", slot.pid, slot.slot, shown(&path));
                }
                changed_any |= !changed.is_empty();
            }
            Err(problem) => {
                eprintln!("vgpu-smi: {problem}");
                failed = true;
            }
        }
    }
    if !changed_any {
        let what = match target {
            Target::Pid(pid) => format!("no live process with pid {pid}"),
            Target::All => "no live processes".to_string(),
        };
        eprintln!("vgpu-smi: {what} in the region(s): nothing {verb}");
        return Ok(false);
    }
    Ok(!failed)
}

/// `suspend --release`: every targeted process held and its GPU memory checkpointed.
fn release(options: &SuspendArgs) -> Result<bool, String> {
    let driver = Checkpoint::load()?;
    let target = options.control.pid.map_or(Target::All, Target::Pid);
    let (mut done, mut failed) = (0, false);
    for path in control_paths(&options.control.regions, &mut failed) {
        match release::release(&path, target, &driver, options.lock_timeout) {
            Ok(outcome) => {
                done += outcome.done;
                failed |= outcome.failed;
            }
            Err(problem) => {
                eprintln!("vgpu-smi: {problem}");
                failed = true;
            }
        }
    }
    if done == 0 && !failed {
        eprintln!("vgpu-smi: no live process to release in the region(s)");
        return Ok(false);
    }
    Ok(!failed)
}

fn set_command(options: &SetArgs) -> Result<bool, String> {
    let mut failed = false;
    for path in region_arguments(&options.regions) {
        if path.is_dir() {
            eprintln!(
                "vgpu-smi: {}: set changes one container's region: name its file, not a directory",
                shown(&path)
            );
            failed = true;
            continue;
        }
        match limits::set_limits(&path, options.device, options.memory, options.sm) {
            Ok(changes) => {
                println!("{}:", shown(&path));
                for change in changes {
                    println!("  {}", change.describe());
                }
            }
            Err(problem) => {
                eprintln!("vgpu-smi: {problem}");
                failed = true;
            }
        }
    }
    Ok(!failed)
}

fn plot_command(options: &PlotArgs) -> Result<bool, String> {
    let (input, output) = (&options.input, &options.output);
    let text = std::fs::read_to_string(input).map_err(|error| format!("{}: {error}", shown(input)))?;
    let summary = plot::plot_record(&text, Path::new(output))?;
    println!(
        "wrote {}: {} samples, {} device{}{}",
        shown(output),
        summary.samples,
        summary.devices,
        if summary.devices == 1 { "" } else { "s" },
        if summary.skipped_lines > 0 {
            format!(" ({} unreadable lines skipped)", summary.skipped_lines)
        } else {
            String::new()
        }
    );
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_times() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_time(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_time(1_767_225_599_000), "2025-12-31 23:59:59 UTC");
        assert_eq!(format_time(253_402_300_799_999), "9999-12-31 23:59:59 UTC");
        assert_eq!(format_time(u64::MAX), "18446744073709551615 ms since 1970");
    }
}
