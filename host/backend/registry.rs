//! The backend registry: names to factories (`cpu`, `device`, `nccl`, `auto`, and any a user
//! registers). The public face reaches the backends only through it.

use super::{cpu, device, nccl};
use crate::contracts::backend::{Backend, BackendFactory, BackendInit};
use crate::contracts::error::{Error, Result};
use crate::contracts::placement::Device;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

fn registry() -> &'static RwLock<HashMap<String, BackendFactory>> {
    static R: OnceLock<RwLock<HashMap<String, BackendFactory>>> = OnceLock::new();
    R.get_or_init(|| {
        let mut m: HashMap<String, BackendFactory> = HashMap::new();
        m.insert("cpu".into(), Arc::new(cpu::create));
        m.insert("device".into(), Arc::new(device::create));
        m.insert("nccl".into(), Arc::new(nccl::create));
        m.insert("auto".into(), Arc::new(auto));
        RwLock::new(m)
    })
}

/// `auto`: host memory means the CPU backend; a CUDA device the device backend, else NCCL,
/// else the CPU backend, the first that this machine can run (the CPU backend refuses a CUDA
/// device, so that is an `Unavailable` error listing every backend's reason). Ranks decide
/// alike when their machines are alike; mixed jobs name a backend.
fn auto(init: &BackendInit) -> Result<Box<dyn Backend>> {
    let mut why = Vec::new();
    type Create = fn(&BackendInit) -> Result<Box<dyn Backend>>;
    let order: [(&str, Create); 3] = [("device", device::create), ("nccl", nccl::create), ("cpu", cpu::create)];
    let skip = if init.device == Device::Cpu { 2 } else { 0 };
    for (name, create) in order.into_iter().skip(skip) {
        match create(init) {
            Ok(b) => {
                tracing::info!(backend = name, passed_over = ?why, "auto backend");
                return Ok(b);
            }
            Err(Error::Unavailable { reason, .. }) => why.push(format!("{name}: {reason}")),
            Err(e) => return Err(e),
        }
    }
    Err(Error::Unavailable {
        backend: "auto".into(),
        reason: why.join("; "),
    })
}

/// Registers (or replaces) the backend factory called `name`.
pub fn register_backend(name: &str, factory: BackendFactory) {
    registry()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(name.to_owned(), factory);
}

/// Names of the registered backends, sorted.
pub fn backend_names() -> Vec<String> {
    let mut v: Vec<String> = registry()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .keys()
        .cloned()
        .collect();
    v.sort();
    v
}

/// The factory registered as `name` (a user backend may wrap a built-in one).
pub fn backend_factory(name: &str) -> Result<BackendFactory> {
    registry()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(name)
        .cloned()
        .ok_or_else(|| Error::UnknownBackend(name.to_owned(), backend_names().join(", ")))
}
