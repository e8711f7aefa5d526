//! Heap bytes per (holder, block): kvroute's own estimate (`Index::stats`), ChainIndex's own
//! counters, and for both the live bytes a counting allocator saw the index take. Prints a
//! table; measures no time.

mod common;

use common::ChainFleet;
use kvroute_bench::{Fleet, Layout, WORKERS};
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting live bytes.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is `System.dealloc`'s.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract is `System.realloc`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn main() {
    println!("| block | index | groups | (holder, block) pairs | distinct blocks | own estimate B | own B/pair | allocator B | allocator B/pair |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for block in [16, 64] {
        let f = Fleet::new(block);
        let cf = ChainFleet::new(&f);
        for layout in Layout::ALL {
            let events = f.store_events(layout);
            let before = live();
            let index = kvroute_index::Index::new();
            index.apply_all(&events);
            let taken = (live() - before) as f64;
            let s = index.stats();
            assert_eq!(s.block_copies as usize, f.holder_blocks(layout));
            let pairs = s.block_copies as f64;
            println!(
                "| {block} | kvroute | {} | {} | {} | {} | {:.1} | {} | {:.1} |",
                layout.groups(),
                s.block_copies,
                f.distinct_blocks(),
                s.heap_bytes,
                s.heap_bytes as f64 / pairs,
                taken,
                taken / pairs,
            );
            drop(index);
        }
        let before = live();
        let chain = {
            let mut c = cf.empty();
            cf.store(&mut c);
            c
        };
        let taken = (live() - before) as f64;
        let st = chain.index.stats();
        let maps: usize = chain.maps.iter().map(|m| m.capacity() * 17).sum();
        let own = st.arena_bytes - st.arena_free_bytes + st.header_bytes + maps;
        let pairs = (WORKERS * f.blocks_per_worker()) as f64;
        println!(
            "| {block} | chain | 1 | {} | {} | {own} | {:.1} | {} | {:.1} |",
            pairs,
            st.blocks_live,
            own as f64 / pairs,
            taken,
            taken / pairs,
        );
        println!(
            "|   | chain detail | | runs {} | arena {} B (chunks {} B) | headers {} B (slab {} B) | lane maps {} B | | |",
            st.runs_live, st.arena_bytes, st.arena_chunk_bytes, st.header_bytes, st.slab_bytes, maps,
        );
    }
}
