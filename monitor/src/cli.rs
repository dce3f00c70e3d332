//! `vgpu-smi`'s command line, declared with clap's derive API: `--help` for the tool and for every
//! command, `--version`, and errors that name the bad argument (exit status 2).
//!
//! Adding a command: a variant of [`Command`] whose doc comment is its one-line help, an
//! arguments struct (flatten [`Regions`] when it reads regions), and one arm in `main.rs`.

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// What each exit status means; shown at the end of `--help`.
pub const EXIT_STATUS: &str = "\
Exit status:
  0  done
  1  a region could not be read (it is still reported), a file could not be read or written,
     the address could not be listened on, suspend/resume matched no live process, or set
     could not change a region
  2  bad command line (the error names the argument)";

/// `vgpu-smi --version`: the tool's version and the region layout it reads.
pub static VERSION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{}\nregion layout: HAMi-core {}.{} with vgpu extension {}",
        env!("CARGO_PKG_VERSION"),
        vgpu_region::HAMI_MAJOR_VERSION,
        vgpu_region::HAMI_MINOR_VERSION,
        vgpu_region::EXTENSION_VERSION
    )
});

/// The shortest `--watch` interval.
pub const MIN_WATCH: Duration = Duration::from_millis(50);

#[derive(Debug, Parser)]
#[command(
    name = "vgpu-smi",
    version = VERSION.as_str(),
    about = "The GPU memory and compute of vgpu containers, read from their shared regions",
    long_about = "The GPU memory and compute of vgpu containers, read from their shared regions \
                  (no GPU, driver or lock needed). Without a command: `show`.",
    after_help = EXIT_STATUS,
    args_conflicts_with_subcommands = true,
    max_term_width = 100
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The options of `show`, the command run when none is given.
    #[command(flatten)]
    pub show: ShowArgs,
}

impl Cli {
    /// The command to run: `show` with the top-level options when none was given.
    pub fn into_command(self) -> Command {
        self.command.unwrap_or(Command::Show(self.show))
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show the regions as a table or as JSON (the default command)
    #[command(after_help = EXIT_STATUS)]
    Show(ShowArgs),
    /// Serve the regions as Prometheus metrics over HTTP, at /metrics
    #[command(after_help = EXIT_STATUS)]
    Serve(ServeArgs),
    /// Hold processes' kernel launches and copies until `resume`; with --release, also move their
    /// GPU memory to host memory (the driver's checkpoint API) so the GPU is free meanwhile
    #[command(after_help = EXIT_STATUS)]
    Suspend(SuspendArgs),
    /// Let suspended processes run again (released ones are restored onto the GPU first)
    #[command(after_help = EXIT_STATUS)]
    Resume(ControlArgs),
    /// Draw a `--record` file as a PNG or SVG chart
    #[command(after_help = EXIT_STATUS)]
    Plot(PlotArgs),
    /// Change a running container's limits in its region; every process follows them at once
    #[command(after_help = EXIT_STATUS)]
    Set(SetArgs),
}

/// The regions a command reads.
#[derive(Debug, Clone, Default, Args)]
pub struct Regions {
    /// A region file, or a directory of them (one level of subdirectories too); repeatable.
    /// Default: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/cudevshr.cache
    #[arg(long = "region", value_name = "PATH")]
    pub paths: Vec<PathBuf>,
}

#[derive(Debug, Default, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub regions: Regions,
    /// One JSON report (schema in docs/monitoring.md) instead of the table
    #[arg(long)]
    pub json: bool,
    /// Refresh every SECONDS until interrupted: a number of seconds (at least 0.05) or a duration
    /// such as 500ms or 2s
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1", value_parser = watch_interval)]
    pub watch: Option<Duration>,
    /// With --watch: stop after N samples
    #[arg(long, value_name = "N", requires = "watch")]
    pub count: Option<u64>,
    /// Append each sample to FILE as one JSON line (for `plot`)
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,
    /// The time written into JSON reports, in milliseconds since 1970 (for reproducible output)
    #[arg(long, value_name = "UNIX_MS")]
    pub now: Option<u64>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The address to listen on, such as 127.0.0.1:9400 (port 0: any free port)
    #[arg(long, value_name = "ADDR")]
    pub listen: String,
    #[command(flatten)]
    pub regions: Regions,
}

#[derive(Debug, Args)]
pub struct ControlArgs {
    /// This process only (default: every live process of the regions)
    #[arg(long, value_name = "PID", allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(1..))]
    pub pid: Option<i32>,
    #[command(flatten)]
    pub regions: Regions,
}

#[derive(Debug, Args)]
pub struct SuspendArgs {
    #[command(flatten)]
    pub control: ControlArgs,
    /// Also checkpoint each process's GPU memory into host memory and release it from the GPU
    /// (driver r550 or later); `resume` restores it. Its charges stay against the container's limit
    #[arg(long)]
    pub release: bool,
    /// With --release: how long to wait for a process's CUDA calls to drain before leaving it
    /// running (seconds, or a duration such as 500ms)
    #[arg(long, value_name = "SECONDS", default_value = "10", value_parser = lock_timeout, requires = "release")]
    pub lock_timeout: Duration,
}

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// A file written by `--record`
    #[arg(long, value_name = "RECORD")]
    pub input: PathBuf,
    /// The chart to write: FILE.png or FILE.svg
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("limit").required(true).multiple(true).args(["memory", "sm"]))]
pub struct SetArgs {
    /// Region files of running containers (not directories); repeatable.
    /// Default: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/cudevshr.cache
    #[command(flatten)]
    pub regions: Regions,
    /// This region device only (the GPU column of the table; default: every device)
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// The memory limit, as CUDA_DEVICE_MEMORY_LIMIT takes it (4g, 4096m; 0: none)
    #[arg(long, value_name = "SIZE", value_parser = crate::limits::parse_memory)]
    pub memory: Option<u64>,
    /// The compute limit, as CUDA_DEVICE_SM_LIMIT takes it (1..100; 0 or 100: none)
    #[arg(long, value_name = "PERCENT", value_parser = crate::limits::parse_sm)]
    pub sm: Option<u64>,
}

/// A `--watch` interval: seconds as a number (`2.5`), or a duration with its unit (`500ms`).
fn lock_timeout(text: &str) -> Result<Duration, String> {
    let timeout = match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds > 0.0 && seconds <= 3600.0 => Duration::from_secs_f64(seconds),
        Ok(_) => return Err("not a number of seconds above 0 and at most 3600".into()),
        Err(_) => humantime::parse_duration(text).map_err(|error| error.to_string())?,
    };
    if timeout.is_zero() || timeout > Duration::from_secs(3600) {
        return Err("a timeout above 0 and at most an hour".into());
    }
    Ok(timeout)
}

fn watch_interval(text: &str) -> Result<Duration, String> {
    let interval = match text.parse::<f64>() {
        Ok(seconds) if seconds.is_finite() && seconds >= 0.0 => Duration::from_secs_f64(seconds),
        Ok(_) => return Err("not a number of seconds".into()),
        Err(_) => humantime::parse_duration(text).map_err(|error| format!("not seconds or a duration ({error})"))?,
    };
    if interval < MIN_WATCH {
        return Err("the interval must be at least 0.05 seconds".into());
    }
    Ok(interval)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(line: &str) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("vgpu-smi").chain(line.split_whitespace())).map(Cli::into_command)
    }

    #[test]
    fn the_declaration_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_commands_and_options() {
        let Ok(Command::Show(show)) = parse("--region /a --region /b --json --watch 2.5 --count 3") else {
            panic!("not show");
        };
        assert_eq!(show.regions.paths, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert!(show.json);
        assert_eq!(show.watch, Some(Duration::from_millis(2500)));
        assert_eq!(show.count, Some(3));
        let Ok(Command::Show(show)) = parse("--watch --json") else {
            panic!("not show")
        };
        assert_eq!((show.watch, show.json), (Some(Duration::from_secs(1)), true));
        let Ok(Command::Show(show)) = parse("show --watch 500ms") else {
            panic!("not show")
        };
        assert_eq!(show.watch, Some(Duration::from_millis(500)));
        let Ok(Command::Suspend(SuspendArgs { control, .. })) = parse("suspend --pid 42") else {
            panic!("not suspend")
        };
        assert_eq!(control.pid, Some(42));
        let Ok(Command::Serve(serve)) = parse("serve --listen 127.0.0.1:0 --region /r") else {
            panic!("not serve")
        };
        assert_eq!((serve.listen.as_str(), serve.regions.paths.len()), ("127.0.0.1:0", 1));
    }

    #[test]
    fn bad_command_lines_name_the_argument() {
        for (line, named) in [
            ("frobnicate", "frobnicate"),
            ("--frob", "--frob"),
            ("suspend --pid 0", "--pid"),
            ("--pid 5 suspend", "--pid"),
            ("--watch 0", "--watch"),
            ("--watch 10us", "--watch"),
            ("--watch NaN", "--watch"),
            ("--region", "--region"),
            ("--count x --watch", "--count"),
            ("--count 3", "--watch"),
            ("serve", "--listen"),
            ("plot --input r.jsonl", "--output"),
            ("--json serve --listen :0", "serve"),
        ] {
            let error = parse(line).expect_err(line);
            assert_eq!(error.exit_code(), 2, "{line}");
            let message = error.to_string();
            assert!(message.contains(named), "{line}: {message}");
            assert!(message.starts_with("error: "), "{line}: {message}");
        }
    }

    /// What the user sees for these arguments when they only print (help, version), at the
    /// widest the help is laid out for, whatever the terminal running the tests.
    fn printed(arguments: &[&str]) -> String {
        let error = Cli::command()
            .term_width(100)
            .try_get_matches_from(std::iter::once("vgpu-smi").chain(arguments.iter().copied()))
            .expect_err("prints and exits");
        assert_eq!(error.exit_code(), 0, "{arguments:?}");
        error.to_string()
    }

    #[test]
    fn version_names_the_region_layout() {
        let expected = format!(
            "vgpu-smi {}\nregion layout: HAMi-core {}.{} with vgpu extension {}\n",
            env!("CARGO_PKG_VERSION"),
            vgpu_region::HAMI_MAJOR_VERSION,
            vgpu_region::HAMI_MINOR_VERSION,
            vgpu_region::EXTENSION_VERSION
        );
        assert_eq!(printed(&["--version"]), expected);
        assert_eq!(printed(&["-V"]), expected);
        assert!(expected.contains("HAMi-core 1.2 with vgpu extension 2"));
    }

    #[test]
    fn help_for_the_tool_and_every_command() {
        insta::assert_snapshot!("help", printed(&["--help"]));
        for command in ["show", "serve", "suspend", "resume", "plot", "set"] {
            let help = printed(&[command, "--help"]);
            assert_eq!(help, printed(&["help", command]), "{command}");
            assert!(help.contains(&format!("Usage: vgpu-smi {command}")), "{help}");
            assert!(help.contains(EXIT_STATUS), "{command}");
            insta::assert_snapshot!(format!("help_{command}"), help);
        }
        let names: Vec<String> = Cli::command()
            .get_subcommands()
            .map(|command| command.get_name().to_string())
            .collect();
        assert_eq!(
            names,
            ["show", "serve", "suspend", "resume", "plot", "set"],
            "each command has its help snapshot above"
        );
    }
}
