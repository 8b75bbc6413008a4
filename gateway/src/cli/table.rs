//! Human tables: columns padded to their widest cell, numbers right-aligned.

/// A table of text cells under a header row.
#[derive(Debug)]
pub(super) struct Table {
    header: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(super) fn new(header: &[&'static str]) -> Self {
        Self {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    pub(super) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as text, one line per row, ending with a newline.
    pub(super) fn render(&self) -> String {
        let columns = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        // A column whose every cell is a number (or "-") reads best right-aligned.
        let numeric: Vec<bool> = (0..columns)
            .map(|c| {
                !self.rows.is_empty()
                    && self.rows.iter().all(|r| {
                        r.get(c)
                            .is_some_and(|v| v == "-" || v.parse::<f64>().is_ok())
                    })
            })
            .collect();
        let mut out = String::new();
        let header: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (c, width) in widths.iter().enumerate() {
                let cell = row.get(c).map_or("", String::as_str);
                let pad = width - cell.chars().count();
                if c > 0 {
                    line.push_str("  ");
                }
                if numeric[c] {
                    line.extend(std::iter::repeat_n(' ', pad));
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    if c + 1 < columns {
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Bytes as people read them: 1.5 MiB.
pub(super) fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Milliseconds as people read them: 7d, 3h, 90s; −1 is "forever".
pub(super) fn duration_ms(ms: i64) -> String {
    match ms {
        ..0 => "forever".to_owned(),
        0 => "0".to_owned(),
        ms if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1000 == 0 => format!("{}s", ms / 1000),
        ms => format!("{ms}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up_and_numbers_align_right() {
        let mut t = Table::new(&["NAME", "PARTITIONS", "POLICY"]);
        t.row(vec!["cams".into(), "12".into(), "7d".into()]);
        t.row(vec!["readings-long".into(), "3".into(), "forever".into()]);
        assert_eq!(
            t.render(),
            "NAME           PARTITIONS  POLICY\n\
             cams                   12  7d\n\
             readings-long           3  forever\n"
        );
    }

    #[test]
    fn sizes_and_durations_read_as_people_write_them() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 << 30), "3.0 GiB");
        assert_eq!(duration_ms(-1), "forever");
        assert_eq!(duration_ms(604_800_000), "7d");
        assert_eq!(duration_ms(90_000), "90s");
        assert_eq!(duration_ms(1500), "1500ms");
    }
}
