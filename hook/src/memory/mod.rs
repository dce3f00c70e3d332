//! Device memory accounting: every allocation path charged to the container's shared region
//! before the driver is called, every free released, and memory queries answered for the virtual
//! device. `cuda-api.toml` routes the entry points to the handlers of [`data`], [`pools`],
//! [`contexts`], [`vmm`], [`split`] and [`queries`], built on [`charge`], [`pool_sync`],
//! [`mappings`] and [`measure`].

mod accounting;
mod charge;
mod contexts;
mod data;
mod graphs;
mod ledger;
mod location;
mod mappings;
mod measure;
mod pool_sync;
mod pools;
mod queries;
mod restore;
mod sizes;
mod spill;
mod split;
mod units;
mod vmm;

pub use accounting::{Accounting, accounting, limit_configured, no_pools};
pub use contexts::*;
pub use data::*;
pub use graphs::*;
pub use ledger::Charge;
pub use pool_sync::charge_or_refuse;
pub use pools::*;
pub use queries::*;
pub use restore::tick as restore_tick;
pub use spill::{enabled as elastic, tick as elastic_tick};
pub use split::export;
pub use vmm::{map, retain, unmap};
