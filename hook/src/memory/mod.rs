//! Device memory accounting: every allocation path charged to the container's shared region
//! before the driver is called, every free released, and memory queries answered for the virtual
//! device. `cuda-api.toml` routes the entry points to [`handlers`].

mod accounting;
mod devices;
mod handlers;
mod ledger;
mod sizes;
mod units;

pub use accounting::{
    Accounting, accounting, detach_at_exit, limit_configured, no_pools, open_region, start, write_kernel_time,
};
pub use devices::{DeviceEntry, current_ordinal, format_uuid};
pub use handlers::*;
pub use ledger::Charge;
