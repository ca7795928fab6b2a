//! A GGUF written from tensors made as the writer reaches them holds one tensor at a time: the
//! peak of this thread's live heap while writing 16 tensors of 1 MiB stays near one tensor, not
//! the file. (The counter is per thread, so tests running beside it do not move it.)
use k3mini_gguf::writer::GgufWriter;
use k3mini_gguf::{GgmlType, GgufFile};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|live| {
            live.set(live.get() + layout.size());
            let _ = PEAK.try_with(|p| p.set(p.get().max(live.get())));
        });
        // SAFETY: forwarded as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(layout.size())));
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const MIB: usize = 1 << 20;

#[test]
fn a_streamed_write_holds_one_tensor_at_a_time() {
    let out = std::env::temp_dir().join(format!("k3mini-stream-{}.gguf", std::process::id()));
    let mut w = GgufWriter::new();
    w.set(
        "general.architecture",
        k3mini_gguf::Value::String("test".into()),
    );
    for i in 0..16u8 {
        w.add_tensor_with(
            &format!("t{i}"),
            &[(MIB / 4) as u64],
            GgmlType::F32,
            move || Ok(vec![i; MIB]),
        )
        .unwrap();
    }
    let before = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(before));
    let size = w.write(&out).unwrap();
    let peak = PEAK.with(Cell::get) - before;
    assert!(size as usize > 16 * MIB);
    // One tensor and the writer's buffers; holding the file would be 16 MiB.
    assert!(peak < 2 * MIB, "peak {peak} bytes while writing {size}");
    let f = GgufFile::open(&out).unwrap();
    for (i, t) in f.tensors.iter().enumerate() {
        assert!(
            f.raw(t).unwrap().iter().all(|&b| b == i as u8),
            "{}",
            t.name
        );
    }
    // A tensor that makes the wrong number of bytes, or fails, stops the write by name and
    // leaves no file.
    std::fs::remove_file(&out).unwrap();
    let mut w = GgufWriter::new();
    w.add_tensor_with("short", &[8], GgmlType::F32, || Ok(vec![0; 31]))
        .unwrap();
    let e = w.write(&out).unwrap_err().to_string();
    assert!(
        e.contains("short") && e.contains("31 bytes were made, 32 announced"),
        "{e}"
    );
    assert!(!out.exists() && !k3mini_durable::temp_path(&out).exists());
}
