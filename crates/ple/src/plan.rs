//! Page plans: the file pages a set of rows lives on (first to last page of each row), unique,
//! sorted and merged into byte ranges — what prefetch asks the kernel to read ahead of a gather.

use std::ops::Range;

/// Builds the page plan of `indices` (`num_tables` per token, as the hasher writes them) for a
/// table whose sub-table `k` starts at row `base_rows[k]` and has `sizes[k]` rows of `row_bytes`.
/// `pages` is scratch; `out` receives page-aligned byte ranges, sorted, disjoint and not adjacent.
/// Returns the number of unique pages. Rows outside their sub-table are skipped (the gather reports
/// them). Neither buffer is reallocated once it has grown to the window's size.
pub fn page_ranges(
    indices: &[u64],
    base_rows: &[u64],
    sizes: &[u64],
    row_bytes: u64,
    page_size: u64,
    pages: &mut Vec<u64>,
    out: &mut Vec<Range<u64>>,
) -> usize {
    pages.clear();
    out.clear();
    let nt = base_rows.len();
    if nt == 0 || page_size == 0 {
        return 0;
    }
    for (i, &row) in indices.iter().enumerate() {
        let k = i % nt;
        if row >= sizes[k] {
            continue;
        }
        let off = (base_rows[k] + row) * row_bytes;
        let first = off / page_size;
        let last = (off + row_bytes - 1) / page_size;
        pages.extend(first..=last);
    }
    pages.sort_unstable();
    pages.dedup();
    for &p in pages.iter() {
        let start = p * page_size;
        match out.last_mut() {
            Some(r) if r.end == start => r.end = start + page_size,
            _ => out.push(start..start + page_size),
        }
    }
    pages.len()
}

/// The system page size.
pub fn system_page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let ps = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if ps > 0 {
        ps as u64
    } else {
        4096
    }
}
