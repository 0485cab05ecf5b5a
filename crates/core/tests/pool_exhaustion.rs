//! Pool exhaustion in a process of its own, so that no other test shares the pool.
use stitch_core::pool;

#[test]
fn exhaustion_is_counted_never_blocks_and_recovers() {
    let pool = pool::init(1024, 4).unwrap();
    let mut held = Vec::new();
    while let Some(p) = pool::alloc() {
        held.push(p);
        assert!(
            held.len() <= pool.packets(),
            "pool handed out more packets than it has"
        );
    }
    assert!(held.len() >= 1024);
    assert_eq!(pool.stats().exhausted, 1);
    assert!(pool::alloc().is_none());
    assert_eq!(pool.stats().exhausted, 2);
    assert_eq!(pool.stats().in_use, pool.packets());
    // Packets freed on another thread come back to everyone through the global list.
    std::thread::spawn(move || drop(held)).join().unwrap();
    assert!(pool::alloc().is_some(), "freed packets must be reusable");
    assert!(pool.stats().in_use <= 1);
    // The large class runs out on its own, counted apart.
    let large: Vec<_> = std::iter::from_fn(pool::alloc_large).take(100).collect();
    assert!(large.len() >= 4 && large.len() < 100);
    assert_eq!(pool.stats().large_exhausted, 1);
    assert!(pool::alloc().is_some(), "ordinary packets are unaffected");
}
