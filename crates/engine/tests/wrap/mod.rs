//! Test executors that wrap the model executor and change one behaviour: the cache and state
//! operations they hand on unchanged are written once here.

/// The [`sanmai_engine::Executor`] methods a wrapper hands on to its `inner` executor unchanged:
/// geometry, the cache, the state slots and the device-sampling switch.
#[macro_export]
macro_rules! hand_on_cache_ops {
    () => {
        fn geometry(&self) -> sanmai_engine::CacheGeometry {
            self.inner.geometry()
        }
        fn init_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<(), String> {
            self.inner.init_cache(num_blocks, block_size)
        }
        fn reserve_states(&mut self, slots: usize) -> Result<(), String> {
            self.inner.reserve_states(slots)
        }
        fn copy_state(&mut self, src: usize, dst: usize) -> Result<(), String> {
            self.inner.copy_state(src, dst)
        }
        fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), String> {
            self.inner.copy_block(src, dst)
        }
        fn samples_on_device(&self) -> bool {
            self.inner.samples_on_device()
        }
    };
}
