//! `vgpu-smi`'s library: reads vgpu's shared regions without locking them and without a GPU or a
//! driver, and turns what it reads into a table, a JSON report, Prometheus metrics or a plot; it
//! also sets the per-process `suspend` flag that `libvgpu.so` honours.
//!
//! - [`read`]: finding region files and reading them lock-free (a read-only mapping, per-slot
//!   seqlock retries, then [`vgpu_region::read_snapshot`]); a bad file is a one-line message.
//! - `shrink`: a mapped file truncated under the reader reads zeros instead of raising `SIGBUS`.
//! - [`report`]: the [`report::Report`] every output is made from; its JSON form is the stable
//!   schema of `docs/monitoring.md`.
//! - [`liveness`]: whether a slot's process is alive, in the container's pid namespace or the
//!   host's.
//! - [`table`]: the human table (80 columns, binary units).
//! - [`metrics`]: the Prometheus exposition (`prometheus-client`).
//! - [`serve`]: the HTTP endpoint of `vgpu-smi serve` (hyper on one tokio thread, every connection
//!   bounded).
//! - [`cli`]: the command line (clap).
//! - [`control`]: `suspend` / `resume`.
//! - [`release`]: `suspend --release`, the driver's checkpoint API.
//! - [`limits`]: `set`, the container's limits in its region.
//! - [`plot`]: PNG or SVG charts from a `--record` file (`plotters`).

pub mod cli;
pub mod control;
pub mod limits;
pub mod liveness;
pub mod metrics;
pub mod plot;
pub mod read;
pub mod release;
pub mod report;
pub mod serve;
mod shrink;
pub mod table;
pub mod units;

pub use read::{RegionRead, RegionState, discover, read_region};
pub use report::{Report, build_report};
