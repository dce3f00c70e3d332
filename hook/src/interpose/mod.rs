//! How applications reach our wrappers: the exported `dlsym` and the `cuGetProcAddress` family.

pub mod dlsym;
pub mod proc_address;
pub mod unmapped;

pub use proc_address::get_proc_address;
