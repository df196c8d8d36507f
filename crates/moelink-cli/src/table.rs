//! Plain-text tables: left-aligned text, right-aligned numbers, and free-text rows (an "unavailable: ..."
//! note) that span the columns after the ones they fill.

/// A table being built.
pub struct Table {
    header: Vec<String>,
    /// Columns whose cells are right-aligned.
    numeric: Vec<bool>,
    rows: Vec<Row>,
}

enum Row {
    Cells(Vec<String>),
    /// The first cells, then a note in place of the rest.
    Note(Vec<String>, String),
}

impl Table {
    /// A table with these column titles; `numeric[i]` right-aligns column `i`.
    pub fn new(header: &[&str], numeric: &[bool]) -> Table {
        Table { header: header.iter().map(|s| s.to_string()).collect(), numeric: numeric.to_vec(), rows: Vec::new() }
    }

    /// A full row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(Row::Cells(cells));
    }

    /// A row whose leading `cells` are filled and whose remaining columns hold one `note`.
    pub fn note(&mut self, cells: Vec<String>, note: String) {
        self.rows.push(Row::Note(cells, note));
    }

    /// The table as text, one line per row, header underlined.
    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut width: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            let cells = match r {
                Row::Cells(c) | Row::Note(c, _) => c,
            };
            for (i, c) in cells.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let cell = |i: usize, s: &str| {
            let pad = width[i].saturating_sub(s.chars().count());
            if self.numeric.get(i).copied().unwrap_or(false) {
                format!("{}{s}", " ".repeat(pad))
            } else {
                format!("{s}{}", " ".repeat(pad))
            }
        };
        let mut out = String::new();
        let line = |cells: &[String]| cells.iter().enumerate().map(|(i, c)| cell(i, c)).collect::<Vec<_>>().join("  ");
        out += line(&self.header).trim_end();
        out.push('\n');
        out += &width.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  ");
        out.push('\n');
        for r in &self.rows {
            match r {
                Row::Cells(c) => out += line(c).trim_end(),
                Row::Note(c, note) => {
                    let lead = line(c);
                    out += &format!("{lead}  {note}");
                }
            }
            out.push('\n');
        }
        out
    }
}

/// A number with a sensible number of digits for a table.
pub fn num(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up_and_notes_span() {
        let mut t = Table::new(&["op", "time µs"], &[false, true]);
        t.row(vec!["dispatch".into(), "12.5".into()]);
        t.note(vec!["combine".into()], "unavailable: not built".into());
        let s = t.render();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "op        time µs");
        assert_eq!(lines[2], "dispatch     12.5");
        assert_eq!(lines[3], "combine   unavailable: not built");
        assert_eq!(num(1234.4), "1234");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(1.234), "1.23");
    }
}
