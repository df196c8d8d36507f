fn main() {
    println!("moelink (placeholder)");
}
