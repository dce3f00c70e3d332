//! Device memory accounting: every allocation path charged to the container's shared region
//! before the driver is called, every free released, and memory queries answered for the virtual
//! device. `cuda-api.toml` routes the entry points to [`handlers`].

mod accounting;
mod handlers;
mod ledger;
mod location;
mod sizes;
mod units;

pub use accounting::no_pools;
pub use handlers::*;
