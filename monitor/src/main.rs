//! `vgpu-smi`: shows vgpu's shared regions (memory and compute per device and per process),
//! serves them as Prometheus metrics, plots recordings, and suspends or resumes processes.
//! `vgpu-smi --help` lists the commands; `docs/monitoring.md` documents them.

use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use vgpu_monitor::control::{self, Target};
use vgpu_monitor::read::{DEFAULT_REGION_PATH, REGION_PATH_VARIABLE, discover, read_region, shown};
use vgpu_monitor::report::{Report, build_report, now_unix_ms, process_is_alive};
use vgpu_monitor::{limits, metrics, plot, table};

const USAGE: &str = "\
vgpu-smi: the GPU memory and compute of vgpu containers, read from their shared regions

usage:
  vgpu-smi [--region PATH]... [--json] [--watch [SECONDS]] [--count N] [--record FILE]
  vgpu-smi serve --listen ADDR [--region PATH]...
  vgpu-smi suspend [--pid PID] [--region PATH]...
  vgpu-smi resume [--pid PID] [--region PATH]...
  vgpu-smi set [--region PATH]... [--device N] [--memory SIZE] [--sm PERCENT]
  vgpu-smi plot --input RECORD --output FILE.png|FILE.svg

  --region PATH     a region file, or a directory of them (one level of subdirectories too);
                    default: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/cudevshr.cache
  --json            one JSON report (schema in docs/monitoring.md) instead of the table
  --watch [SECONDS] refresh every SECONDS (default 1) until interrupted
  --count N         with --watch: stop after N samples
  --record FILE     append each sample to FILE as one JSON line (for `plot`)
  --now UNIX_MS     the time written into JSON reports (for reproducible output)
  --listen ADDR     serve: address to listen on, e.g. 127.0.0.1:9400 (port 0: any free port)
  --pid PID         suspend/resume: this process only (default: every live process)
  --memory SIZE     set: the memory limit, as CUDA_DEVICE_MEMORY_LIMIT takes it (4g, 4096m; 0: none)
  --sm PERCENT      set: the compute limit, as CUDA_DEVICE_SM_LIMIT takes it (1..100; 0 or 100: none)
  --device N        set: this region device only (the GPU column; default: every device)
                    set changes the limits of a running container's region (region files, not
                    directories); every process of the container follows them at once

exit status: 0 done; 1 a region could not be read or no process matched; 2 bad usage";

/// A parsed command line.
#[derive(Debug, Default)]
struct Options {
    command: Command,
    regions: Vec<PathBuf>,
    json: bool,
    watch: Option<f64>,
    count: Option<u64>,
    record: Option<PathBuf>,
    now: Option<u64>,
    listen: Option<String>,
    pid: Option<i32>,
    input: Option<PathBuf>,
    output: Option<PathBuf>,
    device: Option<usize>,
    memory: Option<u64>,
    sm: Option<u64>,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum Command {
    #[default]
    Show,
    Serve,
    Suspend,
    Resume,
    Plot,
    Set,
    Help,
    Version,
}

fn parse(arguments: Vec<OsString>) -> Result<Options, String> {
    let mut options = Options::default();
    let mut arguments = arguments.into_iter().peekable();
    let mut first = true;
    while let Some(argument) = arguments.next() {
        let text = argument.to_string_lossy().into_owned();
        if first && !text.starts_with('-') {
            options.command = match text.as_str() {
                "serve" => Command::Serve,
                "suspend" => Command::Suspend,
                "resume" => Command::Resume,
                "plot" => Command::Plot,
                "set" => Command::Set,
                "help" => Command::Help,
                other => return Err(format!("unknown command {other:?}")),
            };
            first = false;
            continue;
        }
        first = false;
        let mut value = |name: &str| arguments.next().ok_or_else(|| format!("{name} needs a value"));
        match text.as_str() {
            "-h" | "--help" => options.command = Command::Help,
            "-V" | "--version" => options.command = Command::Version,
            "--json" => options.json = true,
            "--region" => options.regions.push(PathBuf::from(value("--region")?)),
            "--record" => options.record = Some(PathBuf::from(value("--record")?)),
            "--input" => options.input = Some(PathBuf::from(value("--input")?)),
            "--output" => options.output = Some(PathBuf::from(value("--output")?)),
            "--listen" => options.listen = Some(value("--listen")?.to_string_lossy().into_owned()),
            "--count" => options.count = Some(number(&value("--count")?, "--count")?),
            "--now" => options.now = Some(number(&value("--now")?, "--now")?),
            "--device" => options.device = Some(number(&value("--device")?, "--device")?),
            "--memory" => {
                let text = value("--memory")?.to_string_lossy().into_owned();
                options.memory =
                    Some(limits::parse_memory(&text).map_err(|problem| format!("--memory {text:?}: {problem}"))?);
            }
            "--sm" => {
                let text = value("--sm")?.to_string_lossy().into_owned();
                options.sm = Some(limits::parse_sm(&text).map_err(|problem| format!("--sm {text:?}: {problem}"))?);
            }
            "--pid" => {
                let pid = number::<i32>(&value("--pid")?, "--pid")?;
                if pid <= 0 {
                    return Err("--pid must be positive".into());
                }
                options.pid = Some(pid);
            }
            "--watch" => {
                let seconds = match arguments.peek().map(|next| next.to_string_lossy().parse::<f64>()) {
                    Some(Ok(seconds)) => {
                        arguments.next();
                        seconds
                    }
                    _ => 1.0,
                };
                if !(seconds.is_finite() && seconds >= 0.05) {
                    return Err("--watch needs an interval of at least 0.05 seconds".into());
                }
                options.watch = Some(seconds);
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(options)
}

fn number<T: std::str::FromStr>(value: &OsString, name: &str) -> Result<T, String> {
    value
        .to_string_lossy()
        .parse()
        .map_err(|_| format!("{name}: {:?} is not a number", value.to_string_lossy()))
}

fn main() -> ExitCode {
    let options = match parse(std::env::args_os().skip(1).collect()) {
        Ok(options) => options,
        Err(problem) => {
            eprintln!("vgpu-smi: {problem}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match options.command {
        Command::Help => {
            println!("{USAGE}");
            Ok(true)
        }
        Command::Version => {
            println!("vgpu-smi {}", env!("CARGO_PKG_VERSION"));
            Ok(true)
        }
        Command::Show => show(&options),
        Command::Serve => serve(&options),
        Command::Suspend => suspend_or_resume(&options, true),
        Command::Resume => suspend_or_resume(&options, false),
        Command::Plot => plot_command(&options),
        Command::Set => set_command(&options),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(problem) => {
            eprintln!("vgpu-smi: {problem}");
            ExitCode::from(if problem.starts_with("usage:") { 2 } else { 1 })
        }
    }
}

/// The `--region` arguments, or the library's region path.
fn region_arguments(options: &Options) -> Vec<PathBuf> {
    if !options.regions.is_empty() {
        return options.regions.clone();
    }
    let path = std::env::var_os(REGION_PATH_VARIABLE)
        .filter(|value| !value.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_REGION_PATH), PathBuf::from);
    vec![path]
}

/// Reads every region named by the arguments now. A path that cannot be listed is reported as
/// an unreadable region, so it shows up in every output.
fn sample(options: &Options) -> Report {
    let mut reads = Vec::new();
    for argument in region_arguments(options) {
        match discover(&argument) {
            Ok(paths) => reads.extend(paths.iter().map(|path| read_region(path))),
            Err(problem) => reads.push(vgpu_monitor::RegionRead {
                path: argument.clone(),
                result: Err(problem),
            }),
        }
    }
    build_report(&reads, options.now.unwrap_or_else(now_unix_ms), process_is_alive)
}

fn all_readable(report: &Report) -> bool {
    report.regions.iter().all(|region| region.error.is_none())
}

fn show(options: &Options) -> Result<bool, String> {
    if options.count.is_some() && options.watch.is_none() {
        return Err("usage: --count needs --watch".into());
    }
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
        let report = sample(options);
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
            (false, Some(seconds)) => write!(
                stdout,
                "\x1b[H\x1b[2J{}  (every {seconds}s, sample {samples})\n\n{}",
                format_time(report.time_unix_ms),
                table::render(&report)
            ),
            (false, None) => write!(stdout, "{}", table::render(&report)),
        };
        // A closed pipe (`vgpu-smi --watch | head`) ends the program quietly.
        if written.and_then(|()| stdout.flush()).is_err() {
            return Ok(true);
        }
        drop(stdout);
        let Some(seconds) = options.watch else {
            return Ok(all_readable(&report));
        };
        if options.count.is_some_and(|count| samples >= count) {
            return Ok(all_readable(&report));
        }
        std::thread::sleep(Duration::from_secs_f64(seconds));
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` from milliseconds since the epoch.
fn format_time(unix_ms: u64) -> String {
    let seconds = unix_ms / 1000;
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let shifted = days as i64 + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

fn serve(options: &Options) -> Result<bool, String> {
    let Some(listen) = &options.listen else {
        return Err("usage: serve needs --listen ADDR".into());
    };
    let server =
        tiny_http::Server::http(listen.as_str()).map_err(|error| format!("cannot listen on {listen}: {error}"))?;
    let address = server
        .server_addr()
        .to_ip()
        .map_or_else(|| listen.clone(), |address| address.to_string());
    println!("vgpu-smi: serving metrics on http://{address}/metrics");
    let _ = std::io::stdout().flush();
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let response = match (request.method(), path.as_str()) {
            (tiny_http::Method::Get, "/metrics") => match metrics::encode_report(&sample(options)) {
                Ok(text) => text_response(200, metrics::CONTENT_TYPE, text),
                Err(error) => text_response(500, "text/plain; charset=utf-8", format!("encoding failed: {error}\n")),
            },
            (tiny_http::Method::Get, "/") => text_response(
                200,
                "text/plain; charset=utf-8",
                "vgpu-smi: metrics are at /metrics\n".to_string(),
            ),
            _ => text_response(
                404,
                "text/plain; charset=utf-8",
                "not found; metrics are at /metrics\n".into(),
            ),
        };
        if let Err(error) = request.respond(response) {
            eprintln!("vgpu-smi: answering a scrape: {error}");
        }
    }
    Ok(true)
}

fn text_response(status: u16, content_type: &str, body: String) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let response = tiny_http::Response::from_string(body).with_status_code(status);
    match tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes()) {
        Ok(header) => response.with_header(header),
        Err(()) => response,
    }
}

fn suspend_or_resume(options: &Options, suspend: bool) -> Result<bool, String> {
    let target = options.pid.map_or(Target::All, Target::Pid);
    let verb = if suspend { "suspended" } else { "resumed" };
    let mut changed_any = false;
    let mut failed = false;
    for argument in region_arguments(options) {
        let paths = match discover(&argument) {
            Ok(paths) => paths,
            Err(problem) => {
                eprintln!("vgpu-smi: {}: {problem}", shown(&argument));
                failed = true;
                continue;
            }
        };
        for path in paths {
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

fn set_command(options: &Options) -> Result<bool, String> {
    if options.memory.is_none() && options.sm.is_none() {
        return Err("usage: set needs --memory SIZE or --sm PERCENT (or both)".into());
    }
    let mut failed = false;
    for path in region_arguments(options) {
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

fn plot_command(options: &Options) -> Result<bool, String> {
    let (Some(input), Some(output)) = (&options.input, &options.output) else {
        return Err("usage: plot needs --input RECORD and --output FILE.png|FILE.svg".into());
    };
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

    fn arguments(line: &str) -> Vec<OsString> {
        line.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn parses_commands_and_options() {
        let options = parse(arguments("--region /a --region /b --json --watch 2.5 --count 3")).unwrap();
        assert_eq!(options.command, Command::Show);
        assert_eq!(options.regions, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert!(options.json);
        assert_eq!(options.watch, Some(2.5));
        assert_eq!(options.count, Some(3));
        assert_eq!(parse(arguments("--watch --json")).unwrap().watch, Some(1.0));
        let options = parse(arguments("suspend --pid 42")).unwrap();
        assert_eq!((options.command, options.pid), (Command::Suspend, Some(42)));
        assert!(parse(arguments("--pid 0 suspend")).is_err());
        assert!(parse(arguments("frobnicate")).is_err());
        assert!(parse(arguments("--watch 0")).is_err());
        assert!(parse(arguments("--region")).is_err());
        assert!(parse(arguments("--count x")).is_err());
        let options = parse(arguments("set --device 1 --memory 4g --sm 30")).unwrap();
        assert_eq!(
            (options.command, options.device, options.memory, options.sm),
            (Command::Set, Some(1), Some(4 << 30), Some(30))
        );
        assert_eq!(parse(arguments("set --sm 100")).unwrap().sm, Some(0), "100 is no limit");
        for bad in [
            "set --memory 4q",
            "set --sm 101",
            "set --sm -1",
            "set --device x",
            "set --memory",
        ] {
            assert!(parse(arguments(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats_utc_times() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_time(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_time(1_767_225_599_000), "2025-12-31 23:59:59 UTC");
    }
}
