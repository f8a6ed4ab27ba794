"""Shop inventory and customer orders (a toolworld environment; this whole file is the environment's class code)."""

SUMMARY = "Shop inventory and orders"
INTRODUCTION = (
    "A small online shop. Products have a SKU such as SKU-4411, a name, a price in dollars and a stock count. "
    "Orders have an id such as ORD-3, a customer, one product SKU, a quantity, a total and a status "
    "(placed, shipped or cancelled)."
)
RULES = [
    "An order needs enough stock; placing it takes the quantity out of stock.",
    "Only placed orders can be cancelled; cancelling puts the quantity back into stock.",
    "Quantities must be positive whole numbers and prices positive.",
]


class ShopEnv:
    """Products {sku: {"name", "price", "stock"}}, orders {id: {"customer", "sku", "quantity", "total", "status"}}."""

    def __init__(self, init_config: dict | None = None):
        self.products = {}
        self.orders = {}
        self.next_order_number = 1
        for key, value in (init_config or {}).items():
            setattr(self, key, value)

    def search_products(self, query: str) -> dict:
        """Find products whose name contains some text.

        Args:
            query: Part of the product name.
        """
        found = [
            {"sku": sku, **product}
            for sku, product in sorted(self.products.items())
            if query.strip().lower() in product["name"].lower()
        ]
        return {"success": True, "products": found}

    def get_product(self, sku: str) -> dict:
        """Get one product with its price and stock.

        Args:
            sku: The product SKU, for example "SKU-4411".
        """
        product = self.products.get(sku)
        if product is None:
            return {"success": False, "error": f"no product with SKU {sku!r}"}
        return {"success": True, "product": {"sku": sku, **product}}

    def place_order(self, customer: str, sku: str, quantity: int) -> dict:
        """Place an order for a customer.

        Args:
            customer: The customer's name.
            sku: The product SKU, for example "SKU-4411".
            quantity: How many units to order, for example 2.
        """
        product = self.products.get(sku)
        if product is None:
            return {"success": False, "error": f"no product with SKU {sku!r}"}
        if quantity <= 0:
            return {"success": False, "error": "quantity must be positive"}
        if product["stock"] < quantity:
            return {"success": False, "error": f"only {product['stock']} units of {sku} in stock"}
        product["stock"] -= quantity
        order_id = f"ORD-{self.next_order_number}"
        self.next_order_number += 1
        total = round(product["price"] * quantity, 2)
        self.orders[order_id] = {
            "customer": customer,
            "sku": sku,
            "quantity": quantity,
            "total": total,
            "status": "placed",
        }
        return {"success": True, "order_id": order_id, "total": total}

    def list_orders(self, customer: str = "") -> dict:
        """List orders, optionally only those of one customer.

        Args:
            customer: The customer's name; empty for all orders.
        """
        found = [
            {"order_id": order_id, **order}
            for order_id, order in sorted(self.orders.items())
            if not customer or order["customer"].lower() == customer.strip().lower()
        ]
        return {"success": True, "orders": found}

    def cancel_order(self, order_id: str) -> dict:
        """Cancel a placed order and return its units to stock.

        Args:
            order_id: The order id, for example "ORD-3".
        """
        order = self.orders.get(order_id)
        if order is None:
            return {"success": False, "error": f"no order with id {order_id!r}"}
        if order["status"] != "placed":
            return {"success": False, "error": f"order {order_id} is {order['status']} and cannot be cancelled"}
        order["status"] = "cancelled"
        self.products[order["sku"]]["stock"] += order["quantity"]
        return {"success": True, "order_id": order_id, "status": "cancelled"}

    def restock(self, sku: str, quantity: int) -> dict:
        """Add units to a product's stock.

        Args:
            sku: The product SKU, for example "SKU-4411".
            quantity: How many units to add, for example 10.
        """
        product = self.products.get(sku)
        if product is None:
            return {"success": False, "error": f"no product with SKU {sku!r}"}
        if quantity <= 0:
            return {"success": False, "error": "quantity must be positive"}
        product["stock"] += quantity
        return {"success": True, "sku": sku, "stock": product["stock"]}

    def set_price(self, sku: str, price: float) -> dict:
        """Change a product's price.

        Args:
            sku: The product SKU, for example "SKU-4411".
            price: The new price in dollars, for example 25.
        """
        product = self.products.get(sku)
        if product is None:
            return {"success": False, "error": f"no product with SKU {sku!r}"}
        if price <= 0:
            return {"success": False, "error": "price must be positive"}
        product["price"] = price
        return {"success": True, "sku": sku, "price": price}
