//! What the backend's device memory holds, by purpose ([`CudaBackend::memory`]).

use std::sync::atomic::Ordering;

use super::CudaBackend;

/// Device memory by purpose, in bytes (what the memory plan prints).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    pub weights: usize,
    pub kv_pools: usize,
    /// GDN state slots (conv state at 2 bytes a value, recurrent state at 4), at the pools' capacity.
    pub gdn_states: usize,
    /// Persistent workspace: step metadata, expert address tables, RoPE tables. Intermediate tensors
    /// come from the stream-ordered allocator's pool and are not counted.
    pub workspace: usize,
}

impl CudaBackend {
    /// Device memory by purpose.
    pub fn memory(&self) -> MemoryReport {
        let st = self.lock();
        MemoryReport {
            weights: self.weight_bytes.load(Ordering::Relaxed),
            kv_pools: st.kv.bytes(),
            gdn_states: st.states.bytes(),
            workspace: st.meta.bytes()
                + st.experts.values().map(|t| t.bytes()).sum::<usize>()
                + st.rope.iter().map(|(_, t)| 4 * t.len()).sum::<usize>()
                + st.packed_ws.as_ref().map_or(0, |w| 2 * w.len()),
        }
    }
}
