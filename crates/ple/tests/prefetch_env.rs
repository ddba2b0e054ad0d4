//! `SANMAI_PLE_PREFETCH=0` turns prefetch off (its own test binary: it sets the environment).

use sanmai_ple::PrefetchOptions;

#[test]
fn the_environment_switch() {
    std::env::remove_var("SANMAI_PLE_PREFETCH");
    assert!(PrefetchOptions::from_env().enabled);
    std::env::set_var("SANMAI_PLE_PREFETCH", "0");
    assert!(!PrefetchOptions::from_env().enabled);
    std::env::set_var("SANMAI_PLE_PREFETCH", "1");
    assert!(PrefetchOptions::from_env().enabled);
}
