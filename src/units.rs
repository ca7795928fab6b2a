//! Sizes for people to read.

/// Bytes in binary units: `318.3 MiB`, `10.41 GiB`, `3.6 PiB`.
pub fn bytes(n: f64) -> String {
    const KIB: f64 = 1024.0;
    let gib = KIB.powi(3);
    match n {
        x if x >= gib * KIB.powi(3) => format!("{:.1} EiB", x / (gib * KIB.powi(3))),
        x if x >= gib * KIB.powi(2) => format!("{:.1} PiB", x / (gib * KIB.powi(2))),
        x if x >= gib * KIB => format!("{:.2} TiB", x / (gib * KIB)),
        x if x >= gib => format!("{:.2} GiB", x / gib),
        x if x >= KIB.powi(2) => format!("{:.1} MiB", x / KIB.powi(2)),
        x => format!("{:.1} KiB", x / KIB),
    }
}
